"""`waferscale serve --replicas ...`: engine replicas and the front on Ray Serve (a local cluster, or ADDR's)."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading

log = logging.getLogger("waferscale")
APP_NAME = "waferscale"


def _exit(message: str) -> None:
    print(f"waferscale: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def layout(args, cluster_cpus: float, models: int = 1) -> tuple[int, int, int]:
    """(initial replicas, most replicas, threads per replica) of each of `models` models for the CLI's options on a
    cluster of this many CPUs; exits with a message when the layout cannot be placed (Ray would otherwise wait for
    CPUs forever)."""
    if args.replicas == "auto":
        low, high = args.min_replicas, args.max_replicas
        if not 1 <= low <= high:
            _exit(f"--min-replicas ({low}) must be at least 1 and at most --max-replicas ({high})")
    else:
        try:
            low = high = int(args.replicas)
        except ValueError:
            _exit(f"--replicas takes a number or 'auto', not {args.replicas!r}")
        if low < 1:
            _exit("--replicas must be at least 1")
    threads = args.replica_threads or max(1, int(cluster_cpus) // (high * models))
    if models * high * threads > cluster_cpus:
        each = f"{models} models x " if models > 1 else ""
        _exit(
            f"{each}{high} replica(s) x {threads} thread(s) need {models * high * threads} CPUs but the Ray cluster "
            f"has {cluster_cpus:g}; use fewer --replicas/--max-replicas or --replica-threads, or add nodes"
        )
    return low, high, threads


def serve_on_ray(args, api_keys: list[str], specs: list | None = None) -> None:
    """Start the replicas and the front, serve until SIGTERM/SIGINT, then drain and shut Serve down. `specs`: the
    models of a --models file or several --model (api.models_registry.ModelSpec), each its own deployment of
    --replicas replicas; None: the one model of the command line."""
    try:
        import ray
        from ray import serve
        from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, HTTPOptions, RequestRouterConfig
        from ray.serve.schema import LoggingConfig
    except ImportError:
        _exit("--replicas needs Ray Serve: pip install 'waferscale[ray]'")

    from waferscale.engine.settings import settings_from_args
    from waferscale.scale.autoscale import queue_and_kv_policy
    from waferscale.scale.board import StatsBoard
    from waferscale.scale.front import Front, FrontSettings, ModelEngines
    from waferscale.scale.ray_router import AffinityRouter
    from waferscale.scale.replica import EngineReplica

    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        low, high, threads = layout(args, cpus, len(specs or [None]))
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port))
        if specs is None:
            settings = settings_from_args(args).replace(
                model=os.path.abspath(args.model) if args.model else None,  # replicas do not run in our directory
            )
            models = [(None, "engine", settings)]  # names: the model's own and --served-model-name
        else:  # paths are absolute already (the models file's, and cli's for each --model)
            models = [(list(s.names), d, s.settings) for s, d in zip(specs, _deployment_names(specs))]
        quiet = LoggingConfig(enable_access_log=False)  # a log line per call costs CPU; the plain server has none
        chooser = {"request_router_class": AffinityRouter} if args.routing == "affinity" else {}
        router = RequestRouterConfig(request_routing_stats_period_s=1, request_routing_stats_timeout_s=5, **chooser)
        scaling = {"num_replicas": low}
        if args.replicas == "auto":
            scaling = {
                "autoscaling_config": AutoscalingConfig(
                    min_replicas=low,
                    max_replicas=high,
                    initial_replicas=low,
                    target_ongoing_requests=args.target_ongoing_requests,
                    upscale_delay_s=3,
                    downscale_delay_s=args.downscale_delay,
                    metrics_interval_s=1,
                    look_back_period_s=3,
                    policy=AutoscalingPolicy(policy_function=queue_and_kv_policy),
                )
            }
        engines = []
        for names, deployment_name, settings in models:
            deployment = serve.deployment(EngineReplica).options(
                name=deployment_name,
                ray_actor_options={"num_cpus": threads},
                # our engine queues, not Serve's handle
                max_ongoing_requests=settings.max_num_seqs + args.max_waiting,
                request_router_config=router,
                graceful_shutdown_timeout_s=args.shutdown_grace,  # scale-down and shutdown let in-flight finish
                graceful_shutdown_wait_loop_s=1,
                health_check_period_s=2,
                logging_config=quiet,
                **scaling,
            )
            board = StatsBoard.remote()  # one per model: each model's client reads its own replicas
            engines.append(ModelEngines(names, deployment.bind(settings.replace(threads=threads), board), board))
        front = serve.deployment(Front).options(
            name="front", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, logging_config=quiet
        )
        front_settings = FrontSettings(
            api_keys=api_keys,
            api_keys_file=args.api_keys_file and os.path.abspath(args.api_keys_file),
            served_model_names=args.served_model_name,
            log_requests=args.log_requests,
            fault_injection=args.enable_fault_injection,
            max_waiting=args.max_waiting,
            affinity=args.routing == "affinity",
            batch=_front_batch_settings(args),
        )
        log.info(
            "starting %s on Ray: %s engine replica(s) x %d thread(s) each, %s routing (cluster: %g CPUs)",
            ", ".join(s.name for s in specs) if specs else args.model or "the built-in model",
            f"{low}-{high}" if args.replicas == "auto" else low,
            threads,
            args.routing,
            cpus,
        )
        serve.run(
            front.bind(engines, front_settings),
            name=APP_NAME,
            route_prefix="/",
            blocking=False,
        )
        log.info("serving on http://%s:%d (Ray Serve's HTTP proxy)", args.host, args.port)
        _wait_for_signal()
        log.info("shutting down: in-flight requests have %g s to finish", args.shutdown_grace)
        serve.delete(APP_NAME)
        if not args.ray_address:  # our own local cluster; a cluster we joined keeps Serve for its other apps
            serve.shutdown()
    finally:
        ray.shutdown()


def _deployment_names(specs: list) -> list[str]:
    """Each model's engine deployment: `engine-` and its name in the characters Serve and process titles take
    (numbered where two names come out the same)."""
    names: list[str] = []
    for i, spec in enumerate(specs):
        name = "engine-" + re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name)
        names.append(name if name not in names else f"{name}-{i + 1}")
    return names


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1):
        pass
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # a second signal exits at once


def _front_batch_settings(args):
    """The Files and Batch APIs' settings for the one front (the database's only writer), with an absolute data
    directory: the front does not run in our directory."""
    from waferscale.api.batch_config import BatchSettings
    from waferscale.cli import batch_settings

    settings: BatchSettings = batch_settings(args)
    settings.data_dir = settings.directory().resolve()
    return settings
