"""`--replicas auto`: Serve's custom autoscaling policy over what the replicas report (queue depth, KV use) and
the calls in flight: up when busy for upscale_delay_s, down by one when the load would fit one replica fewer for
downscale_delay_s (Serve then drains the replica it stops: its in-flight sequences finish)."""

from __future__ import annotations

import math

KV_HIGH = 0.85  # mean KV-cache use above which more replicas are wanted (sequences would soon be preempted)
KV_LOW = 0.5  # ... and below which one fewer may do


def decide(n: int, ongoing: float, waiting: float, kv: float, target: float) -> int:
    """Replicas wanted now for `ongoing` calls in flight, `waiting` sequences queued in engines and mean KV use
    `kv`, `target` ongoing calls per replica (pure: the delays and bounds are applied by the policy)."""
    if n == 0:
        return 1
    if ongoing > n * target:
        return max(n + 1, math.ceil(ongoing / target))
    if waiting > 0 or kv > KV_HIGH:
        return n + 1
    if n > 1 and ongoing <= (n - 1) * target * 0.5 and kv < KV_LOW:
        return n - 1
    return n


def queue_and_kv_policy(ctx) -> tuple[int, dict]:
    """Serve's policy function: the replicas wanted now. Serve itself holds a change back until it has been wanted
    for upscale_delay_s or downscale_delay_s, and keeps it within the bounds."""
    metrics = ctx.aggregated_metrics or {}
    waiting = sum((metrics.get("waiting") or {}).values())
    kv_values = list((metrics.get("kv_usage") or {}).values())
    kv = sum(kv_values) / len(kv_values) if kv_values else 0.0
    target = ctx.config.target_ongoing_requests or 8
    return decide(ctx.current_num_replicas, ctx.total_num_requests, waiting, kv, target), ctx.policy_state
