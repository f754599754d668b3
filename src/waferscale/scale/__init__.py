"""Serving beyond one process: engine replicas on Ray Serve behind our FastAPI front (the `ray` extra).

Only `routing` is pure Python; the other modules import Ray and are loaded only by `waferscale serve --replicas`."""
