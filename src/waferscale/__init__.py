"""waferscale: a self-hosted LLM inference server that speaks the Cerebras Inference API."""

__version__ = "0.1.0"
