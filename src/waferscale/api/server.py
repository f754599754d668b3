"""The FastAPI application: routes, auth, error handlers and an OpenAPI document that matches the spec."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

import msgpack
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from waferscale import __version__
from waferscale.api.auth import BearerAuth, Keyring
from waferscale.api.batch_config import BatchSettings
from waferscale.api.batches import install_batch_api
from waferscale.api.chat import ChatRun, plan_chat, validate_chat_request
from waferscale.api.chat_schemas import (
    ChatCompletionRequest,
    ChatCompletionStreamEvent,
    CreateChatCompletionResponse,
    ErrorResponse,
)
from waferscale.api.completions import CompletionRun, plan_request, validate_request
from waferscale.api.decoding import (
    MAX_BODY_BYTES,
    REQUEST_CONTENT_TYPES,
    BodyDecoder,
    read_limited,
    wants_msgpack,
)
from waferscale.api.errors import FLAT_PATHS, APIError, install_handlers
from waferscale.api.keys import KeyFileError
from waferscale.api.metrics import CONTENT_TYPE, ModelsCollector, UsageCollector, make_registry, render
from waferscale.api.models_registry import ModelRegistry
from waferscale.api.pipeline import Run, ServingContext, check_capacity, shutting_down
from waferscale.api.quota import RateLimitHeaders, reserve
from waferscale.api.schemas import (
    CompletionRequest,
    CreateCompletionResponse,
    HTTPValidationError,
    ModelCard,
    ModelList,
)
from waferscale.api.tiers import QueueTimes, admit, observe
from waferscale.api.tokenize import add_tokenize_routes

log = logging.getLogger("waferscale.api")


def post_doc(schema: str, headers: list[dict]) -> dict:
    """openapi_extra for a POST endpoint: its body is `schema` in every content type we decode, with these header
    parameters, behind the bearer key."""
    body = {t: {"schema": {"$ref": f"#/components/schemas/{schema}"}} for t in REQUEST_CONTENT_TYPES}
    return {
        "requestBody": {"required": True, "content": body},
        "parameters": headers,
        "security": [{"HTTPBearer": []}],
    }


def create_app(
    served: ServingContext | ModelRegistry, api_keys: Keyring | list[str], batch: BatchSettings | None = None
) -> FastAPI:
    """The app serving one model (a ServingContext) or several (a ModelRegistry: a request's `model` picks its
    engine); engine threads start and stop with the app's lifespan. A Keyring with a key file is re-read on SIGHUP.
    `batch` places and bounds the Files and Batch APIs' state."""
    models = served if isinstance(served, ModelRegistry) else ModelRegistry.single(served)
    # Tokenize on the calling thread, never on tokenizers' own pool: a long prompt is then tokenized at the low
    # priority of the thread that asked (pipeline.encode), and takes only the CPU the decoding streams leave.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    auth = BearerAuth(api_keys)
    bodies = BodyDecoder()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        models.start()
        batches.start()
        try:
            bodies.start()  # now: at the first large body its start would cost that request (and the streams)
        except OSError as exc:
            log.warning("cannot start the body parser process (%s); it is tried again at the first large body", exc)
        reloads = auth.keyring.file is not None and _on_sighup(lambda: _reload(auth.keyring))
        try:
            yield
        finally:
            if reloads:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            bodies.close()
            await batches.stop()
            models.stop()

    app = FastAPI(
        title="waferscale",
        version=__version__,
        description="A self-hosted server for the Cerebras Inference API.",
        lifespan=lifespan,
    )
    install_handlers(app)
    app.add_middleware(RateLimitHeaders)
    batches = install_batch_api(app, models, auth, batch)
    queue_times = QueueTimes()  # interactive requests' recent queue times, for queue_threshold

    @app.get("/health", tags=["Server"])
    async def health() -> dict:
        if not models.healthy():  # an engine thread has ended: its model will not be served
            raise APIError(503, "the inference engine is not running", code="engine_unavailable")
        if not models.multi:
            return {"status": "ok"}
        return {"status": "ok", "models": {e.spec.name: e.describe() for e in models.entries}}

    @app.get("/v1/tcp_warming", tags=["Server"])
    async def tcp_warming() -> dict:
        """The official SDK calls this when a client is constructed; it answers at once."""
        return {"status": "ok"}

    if models.multi:  # every series labelled by model
        registry = make_registry(None, None)
        registry.register(ModelsCollector(models))
        for collector in models.collectors:
            registry.register(collector)
    else:
        ctx = models.entries[0].ctx
        registry = make_registry(ctx.engine.stats, lambda: {"rejected_requests": ctx.rejected})
        for collector in ctx.collectors:
            registry.register(collector)
    registry.register(UsageCollector(auth.keyring.usage))

    @app.get("/metrics", tags=["Server"], response_class=PlainTextResponse, dependencies=[Depends(auth)])
    async def metrics() -> str:  # (a Response returned as is; str keeps the documented schema)
        """Prometheus text format: engine queue, KV cache, prefix cache, latencies and the process's RSS and CPU."""
        return Response(render(registry), media_type=CONTENT_TYPE)

    created = served.created if isinstance(served, ServingContext) else int(time.time())

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created)

    def served_card(name: str) -> dict:
        """The hosted card plus, beyond its fields, whether the model is loaded now."""
        return card(name).model_dump() | {"loaded": models.entry(name).state == "loaded"}

    @app.get("/v1/models", tags=["Models"], dependencies=[Depends(auth)])
    async def list_models() -> ModelList:
        if models.multi:
            return JSONResponse({"object": "list", "data": [served_card(n) for n in models.names]})
        return ModelList(data=[card(n) for n in models.names])

    @app.get("/v1/models/{model_id:path}", tags=["Models"], dependencies=[Depends(auth)])
    async def get_model(model_id: str) -> ModelCard:
        models.entry(model_id)  # 404 listing the names served
        return JSONResponse(served_card(model_id)) if models.multi else card(model_id)

    async def read_body(request: Request) -> dict:
        """The decoded request body (JSON or msgpack, optionally gzip), read as a stream under MAX_BODY_BYTES
        whatever its framing, and parsed off the event loop (large bodies in a child process)."""
        body = await read_limited(request.stream(), request.headers.get("content-length"), MAX_BODY_BYTES)
        return await bodies.decode(
            body, request.headers.get("content-type"), request.headers.get("content-encoding")
        )

    def answer(request: Request, result: dict) -> Response:
        """A whole (non-streamed) answer, as msgpack when the request's Accept prefers it, else JSON."""
        if wants_msgpack(request.headers.get("accept")):
            return Response(msgpack.packb(result), media_type="application/msgpack")
        return JSONResponse(result)

    def fault_after(request: Request, ctx: ServingContext) -> int | None:
        fault = request.headers.get("x-waferscale-fault-after", "")
        return int(fault) if ctx.fault_injection and fault.isdigit() else None

    def trace(request: Request, kind: str, user: str | None) -> None:
        trace_id = request.headers.get("cf-ray") or request.headers.get("x-amz-cf-id")
        if user or trace_id:
            log.info("%s request user=%s trace=%s", kind, user, trace_id)
        inert = {h: request.headers[h] for h in INERT_HEADERS if h in request.headers}
        if inert:  # accepted whatever their value; they change nothing here
            log.info("%s request inert headers %s", kind, " ".join(f"{h}={v!r}" for h, v in inert.items()))

    async def respond(
        request: Request, req: CompletionRequest | ChatCompletionRequest, run: CompletionRun | ChatRun, lease
    ) -> Response:
        """Queue a planned run under the caller's key limits and answer: a stream, or the whole body. The model's
        lease is held until the run ends."""
        lease.follow(run.run)
        run.run.cache_key = req.prompt_cache_key
        reserve(request, run.run)  # 429 over the key's limits, before anything is queued
        observe(run.run, queue_times)
        if req.stream:
            await run.run.start()  # admitted (or refused with a real status) before the 200
            return RunStream(run.stream(), run.run)
        return answer(request, await run.collect(request.is_disconnected))

    @app.post(
        "/v1/completions",
        tags=["Completions"],
        summary="Completions",
        operation_id="completions_v1_completions_post",
        dependencies=[Depends(auth)],
        response_model=CreateCompletionResponse,
        responses={422: {"model": HTTPValidationError, "description": "Validation Error"}},
        openapi_extra=post_doc("CompletionRequest", COMPLETION_HEADERS),
    )
    async def completions(request: Request):
        obj = await read_body(request)
        req = validate_request(obj)
        if models.draining:  # shutting down: no new requests (those holding a lease are in flight)
            raise shutting_down()
        async with models.lease(req.model) as lease:  # the engine of the request's model, loaded
            ctx = lease.ctx
            plan = await run_in_threadpool(plan_request, req, ctx)  # tokenization stays off the event loop
            check_capacity(len(plan.prompts) * plan.best_of, ctx)
            trace(request, "completion", req.user)
            return await respond(request, req, CompletionRun(plan, ctx, fault_after(request, ctx)), lease)

    @app.post(
        "/v1/chat/completions",
        tags=["Chat"],
        summary="Chat",
        description="Generate the next assistant message for a conversation. With stream=true the response is "
        "`text/event-stream`.",
        operation_id="chat_v1_chat_completions_post",
        dependencies=[Depends(auth)],
        response_model=CreateChatCompletionResponse,
        responses={422: {"model": HTTPValidationError, "description": "Validation Error"}},
        openapi_extra=post_doc("ChatCompletionRequest", CHAT_HEADERS),
    )
    async def chat_completions(request: Request):
        obj = await read_body(request)
        req = validate_chat_request(obj)
        if models.draining:  # shutting down: no new requests (those holding a lease are in flight)
            raise shutting_down()
        async with models.lease(req.model) as lease:  # the engine of the request's model, loaded
            ctx = lease.ctx
            plan = await run_in_threadpool(plan_chat, req, ctx)  # templating and tokenization off the event loop
            check_capacity(plan.n, ctx)
            trace(request, "chat", req.user)
            run = ChatRun(plan, ctx, fault_after(request, ctx))
            admit(request, req.service_tier.value if req.service_tier else None, run.run, queue_times)
            return await respond(request, req, run, lease)

    add_tokenize_routes(app, models, auth, read_body)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
    return app


class RunStream(StreamingResponse):
    """A run's SSE answer that ends the run however the response ends. Starlette cancels the response of a client
    already gone before the body's generator ever starts, and a generator that never started runs no cleanup: its
    sequences would decode on to max_tokens for nobody, and its quota reservation never be settled."""

    def __init__(self, content, run: Run):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def _on_sighup(callback) -> bool:
    """Run `callback` on the event loop at each SIGHUP; False where signals cannot be handled (not the main
    thread, not Unix)."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, callback)
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def _reload(keyring: Keyring) -> None:
    try:
        keyring.reload()
    except KeyFileError as exc:
        log.error("SIGHUP: keys not reloaded, the ones in use stay: %s", exc)
        return
    log.info("SIGHUP: reloaded %s: keys %s", keyring.file, ", ".join(keyring.names) or "(none)")


def build_openapi(app: FastAPI) -> dict:
    """FastAPI's document under the contracts' title, with their request, response, validation and error schemas
    (by the contracts' names) and the bearer scheme."""
    doc = get_openapi(
        title=CONTRACT_TITLE, version=app.version, description=app.description, routes=app.routes
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    ours: set[str] = set()  # names written from our models (FastAPI's renderings of the same names give way)
    for model in (
        CompletionRequest,
        CreateCompletionResponse,
        HTTPValidationError,
        ChatCompletionRequest,
        ErrorResponse,
        ChatCompletionStreamEvent,
        CreateChatCompletionResponse,
    ):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in [*schema.pop("$defs", {}).items(), (model.model_config["title"], schema)]:
            if name not in ours:  # a name both contracts use keeps the completions shape (the stricter)
                schemas[name] = sub
                ours.add(name)
    doc["components"]["securitySchemes"] = {
        "BearerAuth": {
            "type": "http",
            "scheme": "bearer",
            "description": "API key for authentication, sent as `Authorization: Bearer YOUR_API_KEY`. Required only "
            "when the server was started with --api-key or WAFERSCALE_API_KEY.",
        }
    }
    doc["security"] = [{"BearerAuth": []}]
    ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    # with stream=true, each event's data is one chunk (an ErrorChunkResponse if generation fails), then [DONE]
    ok["text/event-stream"] = {"schema": {"$ref": "#/components/schemas/CreateCompletionResponse"}}
    ok["application/msgpack"] = {"schema": {"$ref": "#/components/schemas/CreateCompletionResponse"}}
    chat_ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    chat_ok["text/event-stream"] = {"schema": {"$ref": "#/components/schemas/ChatCompletionStreamEvent"}}
    chat_ok["application/msgpack"] = {"schema": {"$ref": "#/components/schemas/CreateChatCompletionResponse"}}
    for path in _OPEN_PATHS:
        doc["paths"][path]["get"]["security"] = []  # answered without a key, for load balancers and the SDK
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = _ERROR_CODES.get((method, path), ()) + (() if path in _OPEN_PATHS else (401,))
            shape = "ErrorResponse" if path in FLAT_PATHS else "ErrorChunkResponse"
            for code in sorted(codes):
                op["responses"].setdefault(
                    str(code),
                    {
                        "description": _ERROR_DESCRIPTIONS[code],
                        "content": {
                            "application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}
                        },
                    },
                )
    return doc


CONTRACT_TITLE = "Cerebras Inference Chat Completions API"  # both contracts' info.title
_OPEN_PATHS = ("/health", "/v1/tcp_warming")
# Errors each operation can answer with (besides 401 where a key is required), all as ErrorChunkResponse.
_ERROR_CODES = {
    ("post", "/v1/completions"): (400, 404, 413, 415, 429, 500, 503),
    ("post", "/v1/chat/completions"): (400, 404, 413, 415, 429, 500, 503),
    ("get", "/v1/models/{model_id}"): (404,),
}
_ERROR_DESCRIPTIONS = {
    400: "Invalid request (a value the schema allows but the model or server cannot serve)",
    401: "Missing or wrong API key (only when the server was started with keys)",
    404: "No such model on this server",
    413: "Request body too large",
    415: "Unsupported content type or content encoding",
    429: "Over the key's rate limits, or waiting queue full; retry after the Retry-After header's seconds",
    500: "Generation failed for this request",
    503: "Not admitted before --queue-timeout, or the server is shutting down",
}


def _header(name: str, title: str, schema: dict, description: str | None = None) -> dict:
    param = {
        "in": "header",
        "name": name,
        "required": False,
        "schema": {"anyOf": [schema, {"type": "null"}], "title": title},
    }
    if description:
        param["description"] = description
    return param


# Headers the contracts declare. They are documented here, not validated by FastAPI: the server reads the trace ids
# for its log and accepts any value of the others, which change nothing here (a header that does nothing is never
# a reason to refuse a request).
COMPLETION_HEADERS = [
    _header("X-Amz-Cf-Id", "X-Amz-Cf-Id", {"type": "string"}),
    _header("CF-RAY", "Cf-Ray", {"type": "string"}),
    _header("X-delay-time", "X-Delay-Time", {"type": "number"}),
]
# Headers the contracts name that change nothing here: accepted whatever their value, and logged when sent.
# (queue_threshold acts only with service_tier flex or auto: api/tiers.py)
INERT_HEADERS = ("x-delay-time", "queue_threshold", "x-cerebras-version-patch")
CHAT_HEADERS = COMPLETION_HEADERS + [
    _header(
        "Content-Encoding",
        "Content-Encoding",
        {"enum": ["gzip"], "type": "string"},
        "When `gzip`, the request body is gzip-compressed (combinable with any supported Content-Type).",
    ),
    _header(
        "queue_threshold",
        "Queue Threshold",
        {"pattern": "^[0-9]+$", "type": "string"},
        "Private Preview. Milliseconds, 50-20000. For service_tier flex/auto: reject up front if the rolling average "
        "queue time exceeds this.",
    ),
    _header(
        "X-Cerebras-Version-Patch",
        "X-Cerebras-Version-Patch",
        {"pattern": "^[0-9]+$", "type": "string"},
        "API version override (e.g. `2`). Version 2 becomes the default on 2026-07-21.",
    ),
]
