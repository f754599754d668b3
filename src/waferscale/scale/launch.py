"""`waferscale serve --replicas ...`: engine replicas and the front on Ray Serve (a local cluster, or ADDR's)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger("waferscale")
APP_NAME = "waferscale"


def _exit(message: str) -> None:
    print(f"waferscale: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def layout(args, cluster_cpus: float) -> tuple[int, int, int]:
    """(initial replicas, most replicas, threads per replica) for the CLI's options on a cluster of this many CPUs;
    exits with a message when the layout cannot be placed (Ray would otherwise wait for CPUs forever)."""
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
    threads = args.replica_threads or max(1, int(cluster_cpus) // high)
    if high * threads > cluster_cpus:
        _exit(
            f"{high} replica(s) x {threads} thread(s) need {high * threads} CPUs but the Ray cluster has "
            f"{cluster_cpus:g}; use fewer --replicas/--max-replicas or --replica-threads, or add nodes"
        )
    return low, high, threads


def serve_on_ray(args, api_keys: list[str]) -> None:
    """Start the replicas and the front, serve until SIGTERM/SIGINT, then drain and shut Serve down."""
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
    from waferscale.scale.front import Front, FrontSettings
    from waferscale.scale.ray_router import AffinityRouter
    from waferscale.scale.replica import EngineReplica

    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        low, high, threads = layout(args, cpus)
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port))
        settings = settings_from_args(args).replace(
            model=os.path.abspath(args.model) if args.model else None,  # replicas do not run in our directory
            threads=threads,
        )
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
        engine = serve.deployment(EngineReplica).options(
            name="engine",
            ray_actor_options={"num_cpus": threads},
            max_ongoing_requests=args.max_num_seqs + args.max_waiting,  # our engine queues, not Serve's handle
            request_router_config=router,
            graceful_shutdown_timeout_s=args.shutdown_grace,  # scale-down and shutdown let in-flight finish
            graceful_shutdown_wait_loop_s=1,
            health_check_period_s=2,
            logging_config=quiet,
            **scaling,
        )
        front = serve.deployment(Front).options(
            name="front", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, logging_config=quiet
        )
        board = StatsBoard.remote()
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
            "starting %s on Ray: %s engine replica(s) x %d thread(s), %s routing (cluster: %g CPUs)",
            args.model or "the built-in model",
            f"{low}-{high}" if args.replicas == "auto" else low,
            threads,
            args.routing,
            cpus,
        )
        serve.run(
            front.bind(engine.bind(settings, board), board, front_settings),
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
