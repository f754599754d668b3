"""The FastAPI application: routes, auth, error handlers and an OpenAPI document that matches the spec."""

from __future__ import annotations

import contextlib
import logging

import msgpack
from fastapi import Depends, FastAPI, Header, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from waferscale import __version__
from waferscale.api.auth import BearerAuth
from waferscale.api.completions import (
    CompletionRun,
    ServingContext,
    check_capacity,
    plan_request,
    validate_request,
)
from waferscale.api.decoding import MAX_BODY_BYTES, REQUEST_CONTENT_TYPES, decode_body
from waferscale.api.errors import APIError, install_handlers
from waferscale.api.metrics import CONTENT_TYPE, make_registry, render
from waferscale.api.schemas import (
    CompletionRequest,
    CreateCompletionResponse,
    HTTPValidationError,
    ModelCard,
    ModelList,
)

log = logging.getLogger("waferscale.api")


def create_app(ctx: ServingContext, api_keys: list[str]) -> FastAPI:
    """The app serving `ctx`'s model; the engine thread starts and stops with the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        ctx.engine.start()
        try:
            yield
        finally:
            ctx.engine.stop()

    app = FastAPI(
        title="waferscale",
        version=__version__,
        description="A self-hosted server for the Cerebras Inference API.",
        lifespan=lifespan,
    )
    auth = BearerAuth(api_keys)
    install_handlers(app)

    @app.get("/health", tags=["Server"])
    async def health() -> dict:
        if not ctx.engine.healthy():  # the engine thread has ended: nothing will be served
            raise APIError(503, "the inference engine is not running", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/v1/tcp_warming", tags=["Server"])
    async def tcp_warming() -> dict:
        """The official SDK calls this when a client is constructed; it answers at once."""
        return {"status": "ok"}

    registry = make_registry(ctx.engine.stats, lambda: {"rejected_requests": ctx.rejected})

    @app.get("/metrics", tags=["Server"], response_class=PlainTextResponse, dependencies=[Depends(auth)])
    async def metrics() -> str:  # (a Response returned as is; str keeps the documented schema)
        """Prometheus text format: engine queue, KV cache, prefix cache, latencies and the process's RSS and CPU."""
        return Response(render(registry), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=ctx.created)

    @app.get("/v1/models", tags=["Models"], dependencies=[Depends(auth)])
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in ctx.served_names])

    @app.get("/v1/models/{model_id:path}", tags=["Models"], dependencies=[Depends(auth)])
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in ctx.served_names:
            raise APIError(
                404,
                f"model {model_id!r} does not exist; this server serves: {', '.join(ctx.served_names)}",
                code="model_not_found",
            )
        return card(model_id)

    @app.post(
        "/v1/completions",
        tags=["Completions"],
        summary="Completions",
        operation_id="completions_v1_completions_post",
        dependencies=[Depends(auth)],
        response_model=CreateCompletionResponse,
        responses={422: {"model": HTTPValidationError, "description": "Validation Error"}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    t: {"schema": {"$ref": "#/components/schemas/CompletionRequest"}}
                    for t in REQUEST_CONTENT_TYPES
                },
            },
            "security": [{"HTTPBearer": []}],
        },
    )
    async def completions(
        request: Request,
        x_amz_cf_id: str | None = Header(default=None, alias="X-Amz-Cf-Id"),
        cf_ray: str | None = Header(default=None, alias="CF-RAY"),
        x_delay_time: float | None = Header(default=None, alias="X-delay-time"),
    ):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {declared} bytes; the limit is {MAX_BODY_BYTES}")
        body = await request.body()
        obj = decode_body(body, request.headers.get("content-type"), request.headers.get("content-encoding"))
        req = validate_request(obj)
        plan = plan_request(req, ctx)
        check_capacity(plan, ctx)
        trace = cf_ray or x_amz_cf_id
        if req.user or trace:
            log.info("completion request user=%s trace=%s", req.user, trace)
        fault = request.headers.get("x-waferscale-fault-after", "")
        run = CompletionRun(plan, ctx, int(fault) if ctx.fault_injection and fault.isdigit() else None)
        if req.stream:
            body = await run.start_stream()  # admitted (or refused with a real status) before the 200
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await run.collect(request.is_disconnected)
        if "msgpack" in request.headers.get("accept", ""):
            return Response(msgpack.packb(result), media_type="application/msgpack")
        return JSONResponse(result)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
    return app


def build_openapi(app: FastAPI) -> dict:
    """FastAPI's document, with the spec's CompletionRequest, validation schemas and bearer scheme."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    request_schema = CompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(request_schema.pop("$defs", {}))
    schemas["CompletionRequest"] = request_schema
    validation = HTTPValidationError.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(validation.pop("$defs", {}))
    schemas["HTTPValidationError"] = validation
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
    ok["text/event-stream"] = {  # with stream=true; itemSchema (OpenAPI 3.2) describes each event
        "itemSchema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "description": "one CreateCompletionResponse chunk (an ErrorChunkResponse if generation "
                    "fails), then the literal [DONE]",
                    "anyOf": [
                        {"const": "[DONE]"},
                        {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": {"$ref": "#/components/schemas/CreateCompletionResponse"},
                        },
                    ],
                }
            },
        }
    }
    ok["application/msgpack"] = {"schema": {"$ref": "#/components/schemas/CreateCompletionResponse"}}
    for path in _OPEN_PATHS:
        doc["paths"][path]["get"]["security"] = []  # answered without a key, for load balancers and the SDK
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = _ERROR_CODES.get((method, path), ()) + (() if path in _OPEN_PATHS else (401,))
            for code in sorted(codes):
                op["responses"].setdefault(
                    str(code),
                    {
                        "description": _ERROR_DESCRIPTIONS[code],
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorChunkResponse"}
                            }
                        },
                    },
                )
    return doc


_OPEN_PATHS = ("/health", "/v1/tcp_warming")
# Errors each operation can answer with (besides 401 where a key is required), all as ErrorChunkResponse.
_ERROR_CODES = {
    ("post", "/v1/completions"): (400, 404, 413, 415, 429, 500, 503),
    ("get", "/v1/models/{model_id}"): (404,),
}
_ERROR_DESCRIPTIONS = {
    400: "Invalid request (a value the schema allows but the model or server cannot serve)",
    401: "Missing or wrong API key (only when the server was started with keys)",
    404: "No such model on this server",
    413: "Request body too large",
    415: "Unsupported content type or content encoding",
    429: "Waiting queue full; retry after the Retry-After header's seconds",
    500: "Generation failed for this request",
    503: "Not admitted before --queue-timeout, or the server is shutting down",
}
