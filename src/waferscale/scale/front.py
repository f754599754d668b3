"""The front deployment: our whole FastAPI app (auth, decoding, validation, tokenization, templates, SSE, msgpack,
errors), unchanged, with the Ray client in place of the local engine. It holds no model weights: the tokenizer and
the model's figures come from an engine replica at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve

from waferscale.api.auth import Keyring
from waferscale.api.pipeline import ServingContext
from waferscale.api.server import create_app
from waferscale.models.chat_template import ChatTemplate
from waferscale.scale.metrics import ReplicaCollector
from waferscale.scale.ray_client import RayEngineClient


@dataclass
class FrontSettings:
    """The CLI's HTTP-side options."""

    api_keys: list[str]
    api_keys_file: str | None = None  # absolute: the front does not run in our directory
    served_model_names: list[str] = field(default_factory=list)
    log_requests: bool = False
    fault_injection: bool = False
    max_waiting: int | None = None
    affinity: bool = True
    batch: object = None  # api.batch_config.BatchSettings (None: the defaults)


@serve.ingress()
class Front:
    """Serve deployment class: builds the app once the engine replicas can describe the model."""

    async def __init__(self, engine, board, settings: FrontSettings):
        info = await engine.describe.remote()
        client = RayEngineClient(engine, board, info["block_size"], settings.affinity)
        tokenizer = info["tokenizer"]
        names = [info["name"]] + [n for n in settings.served_model_names if n != info["name"]]
        ctx = ServingContext(
            engine=client,
            tokenizer=tokenizer,
            served_names=names,
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            fingerprint=info["fingerprint"],
            log_requests=settings.log_requests,
            fault_injection=settings.fault_injection,
            max_waiting=settings.max_waiting,
            chat_template=ChatTemplate.for_tokenizer(tokenizer),
            collectors=[ReplicaCollector(client)],
        )
        self._fastapi = create_app(ctx, Keyring(settings.api_keys, settings.api_keys_file), settings.batch)

    def __serve_build_asgi_app__(self):
        return self._fastapi
