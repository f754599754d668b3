"""GET /metrics: the engine's stats snapshot and the process's own figures, rendered by prometheus_client."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from waferscale.engine.metrics import EngineStats, HistogramSnapshot

PREFIX = "waferscale_"
HELP = {
    "running": "sequences in the running batch",
    "waiting": "sequences waiting for admission",
    "kv_blocks_used": "KV-cache blocks held by sequences",
    "kv_blocks_free": "KV-cache blocks free or holding evictable cached prefixes",
    "kv_blocks_cached": "KV-cache blocks holding cached prefixes that no sequence uses",
    "kv_cache_bytes": "memory of the KV cache pool (keys, values and, for --kv-cache-dtype int8, their scales)",
    "kv_cache_tokens": "tokens whose keys and values the KV cache pool holds in every layer",
    "prefix_cache_queries": "prompt blocks looked up in the prefix cache (once per admission)",
    "prefix_cache_hits": "prompt blocks served from the prefix cache (once per admission)",
    "generated_tokens": "tokens generated",
    "preemptions": "sequences preempted to free KV-cache blocks (recomputed later)",
    "queue_timeouts": "requests that waited past the queue timeout",
    "failed_steps": "engine steps that raised (their sequences failed with an internal error)",
    "interrupted_steps": "steps of batch work stopped between layers for an interactive request (run again)",
    "speculative_draft_tokens": "tokens proposed by the server's n-gram speculation (--speculative)",
    "speculative_accepted_tokens": "speculative tokens the model confirmed (emitted without a forward of their own)",
    "rejected_requests": "requests turned away with 429 because the waiting queue was full",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """A prometheus_client collector that reads a fresh EngineStats snapshot at every scrape."""

    def __init__(self, snapshot: Callable[[], EngineStats], extra_counters: Callable[[], dict[str, float]]):
        self.snapshot, self.extra_counters = snapshot, extra_counters

    def collect(self):
        stats = self.snapshot()
        for name in EngineStats.GAUGES:
            yield GaugeMetricFamily(PREFIX + name, HELP[name], value=getattr(stats, name))
        counters = {name: getattr(stats, name) for name in EngineStats.COUNTERS} | self.extra_counters()
        for name, value in counters.items():
            yield CounterMetricFamily(PREFIX + name, HELP.get(name, name), value=value)
        yield _histogram("time_to_first_token_seconds", "arrival to first generated token", stats.ttft)
        yield _histogram("inter_token_latency_seconds", "time between tokens of a sequence", stats.itl)
        if stats.expert_load:  # a mixture of experts: routing skew, per sparse layer and expert
            family = _expert_family([])
            _add_expert_load(family, [], stats.expert_load)
            yield family


def _expert_family(labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(
        PREFIX + "expert_routed_tokens", "tokens routed to each expert, by layer", labels=[*labels, "layer", "expert"]
    )


def _add_expert_load(family: CounterMetricFamily, labels: list[str], load: dict[int, list[int]]) -> None:
    for layer, counts in sorted(load.items()):
        for expert, count in enumerate(counts):
            family.add_metric([*labels, str(layer), str(expert)], count)


class ModelsCollector:
    """Every configured model's engine figures, labelled by model (a server of several models): loaded models'
    engine stats at each scrape, plus each model's loaded state, loads and unloads."""

    def __init__(self, registry):
        self.registry = registry  # api.models_registry.ModelRegistry

    def collect(self):
        loaded = [(e.spec.name, e.ctx, e.ctx.engine.stats()) for e in self.registry.loaded()]
        for name in EngineStats.GAUGES:
            family = GaugeMetricFamily(PREFIX + name, HELP[name], labels=["model"])
            for model, _, stats in loaded:
                family.add_metric([model], getattr(stats, name))
            yield family
        for name in (*EngineStats.COUNTERS, "rejected_requests"):
            family = CounterMetricFamily(PREFIX + name, HELP.get(name, name), labels=["model"])
            for model, ctx, stats in loaded:
                value = ctx.rejected if name == "rejected_requests" else getattr(stats, name)
                family.add_metric([model], value)
            yield family
        for name, help_text, attr in (
            ("time_to_first_token_seconds", "arrival to first generated token", "ttft"),
            ("inter_token_latency_seconds", "time between tokens of a sequence", "itl"),
        ):
            family = HistogramMetricFamily(PREFIX + name, help_text, labels=["model"])
            for model, _, stats in loaded:
                _add_histogram(family, [model], getattr(stats, attr))
            yield family
        experts = _expert_family(["model"])
        for model, _, stats in loaded:
            _add_expert_load(experts, [model], stats.expert_load)
        if experts.samples:
            yield experts
        state = GaugeMetricFamily(PREFIX + "model_loaded", "1 while the model is loaded, else 0", labels=["model"])
        loads = CounterMetricFamily(PREFIX + "model_loads", "times the model was loaded", labels=["model"])
        unloads = CounterMetricFamily(
            PREFIX + "model_unloads", "times the model was unloaded to make room", labels=["model"]
        )
        for e in self.registry.entries:
            state.add_metric([e.spec.name], 1.0 if e.state == "loaded" else 0.0)
            loads.add_metric([e.spec.name], e.loads)
            unloads.add_metric([e.spec.name], e.unloads)
        yield from (state, loads, unloads)


USAGE = {  # KeyUsage field -> (metric name, help)
    "requests": ("key_requests", "requests admitted, by key name"),
    "prompt_tokens": ("key_prompt_tokens", "prompt tokens of finished requests, by key name"),
    "cached_tokens": ("key_cached_tokens", "prompt tokens served from the prefix cache, by key name"),
    "completion_tokens": ("key_completion_tokens", "tokens generated, by key name"),
    "rate_limited": ("key_rate_limited", "requests refused with 429 over the key's limits, by key name"),
}


class UsageCollector:
    """Counters of each key's usage, labelled by key name (the names in the key file, never the keys)."""

    def __init__(self, usage: Callable[[], dict]):
        self.usage = usage

    def collect(self):
        by_name = self.usage()
        for field, (name, help_text) in USAGE.items():
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["key"])
            for key_name, usage in sorted(by_name.items()):
                family.add_metric([key_name], getattr(usage, field))
            yield family


def _histogram(name: str, help_text: str, h: HistogramSnapshot | None) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, help_text)
    _add_histogram(family, [], h)
    return family


def _add_histogram(family: HistogramMetricFamily, labels: list[str], h: HistogramSnapshot | None) -> None:
    if h is None:
        return
    buckets, running = [], 0
    for bound, count in zip(h.buckets, h.counts):
        running += count
        buckets.append((str(bound), running))
    buckets.append(("+Inf", running + h.counts[-1]))
    family.add_metric(labels, buckets, h.total)


def make_registry(
    snapshot: Callable[[], EngineStats] | None, extra_counters: Callable[[], dict[str, float]] | None
):
    """A registry of the engine's figures (none without `snapshot`: the caller registers its own) plus process RSS,
    CPU seconds and open files (ProcessCollector)."""
    registry = CollectorRegistry(auto_describe=False)
    if snapshot is not None:
        registry.register(EngineCollector(snapshot, extra_counters or dict))
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
