"""The front deployment: our whole FastAPI app (auth, decoding, validation, tokenization, templates, SSE, msgpack,
errors), unchanged, with a Ray client per model in place of the local engines. It holds no model weights: each
model's tokenizer and figures come from one of its engine replicas at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve

from waferscale.api.auth import Keyring
from waferscale.api.models_registry import ModelRegistry, ModelSpec
from waferscale.api.pipeline import ServingContext
from waferscale.api.server import create_app
from waferscale.engine.settings import EngineSettings
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


@dataclass
class ModelEngines:
    """One model's engine deployment: the names requests send (None: the model's own name and
    --served-model-name), its handle, and the board its replicas post their stats to."""

    names: list[str] | None
    handle: object
    board: object


@serve.ingress()
class Front:
    """Serve deployment class: builds the app once the engine replicas can describe their models."""

    async def __init__(self, engines: list[ModelEngines], settings: FrontSettings):
        contexts = []
        for model in engines:
            info = await model.handle.describe.remote()
            client = RayEngineClient(model.handle, model.board, info["block_size"], settings.affinity)
            tokenizer = info["tokenizer"]
            names = model.names or [info["name"]] + [n for n in settings.served_model_names if n != info["name"]]
            contexts.append(
                ServingContext(
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
                    collectors=[ReplicaCollector({None: client})] if model.names is None else [],
                )
            )
        if engines[0].names is None:
            served: ServingContext | ModelRegistry = contexts[0]
        else:  # several models: a request's `model` picks its deployment
            specs = [ModelSpec(c.served_names[0], EngineSettings(), tuple(c.served_names[1:])) for c in contexts]
            served = ModelRegistry.serving(specs, contexts)
            served.collectors.append(ReplicaCollector({c.served_names[0]: c.engine for c in contexts}))
        self._fastapi = create_app(served, Keyring(settings.api_keys, settings.api_keys_file), settings.batch)

    def __serve_build_asgi_app__(self):
        return self._fastapi
