"""HTTP layer: schemas mirroring the Cerebras spec, request decoding, auth, SSE streaming and error shapes."""
