"""Per-replica series for the front's /metrics (the totals keep their usual names, from the client's stats()):
every engine figure again as `waferscale_replica_<name>{replica="..."}`, plus KV-cache use as a fraction, which
inference gateways read, and the replica count."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from waferscale.api.metrics import HELP, PREFIX
from waferscale.engine.metrics import EngineStats


def kv_usage(stats: EngineStats) -> float:
    blocks = stats.kv_blocks_used + stats.kv_blocks_free
    return stats.kv_blocks_used / blocks if blocks else 0.0


class ReplicaCollector:
    """Reads the Ray clients' latest per-replica stats at every scrape: one model's ({None: client}), or several
    models' ({name: client}, every series then labelled by model too)."""

    def __init__(self, clients: dict):
        self.clients = clients

    def collect(self):
        models = [m for m in self.clients if m is not None]
        by = ["model"] if models else []

        def key(model) -> list[str]:
            return [model] if model is not None else []

        def family(kind, name: str, help_text: str, labels: list[str], values):
            """`values`: (labels, value) pairs."""
            out = kind(PREFIX + name, help_text, labels=by + labels)
            for label_values, value in values:
                out.add_metric(label_values, value)
            return out

        clients = sorted(self.clients.items(), key=lambda kv: kv[0] or "")
        per = [(model, client, sorted(client.per_replica().items())) for model, client in clients]
        yield family(GaugeMetricFamily, "replicas", "engine replicas reporting", [],
                     [(key(m), len(reps)) for m, _, reps in per])  # fmt: skip
        yield family(
            GaugeMetricFamily, "replica_info", "an engine replica: its Ray node and process id",
            ["replica", "node", "pid"],
            [(key(m) + [r, str(report.get("node", "")), str(report.get("pid", ""))], 1)
             for m, client, _ in per for r, report in sorted(client.replicas.items())],
        )  # fmt: skip
        yield family(GaugeMetricFamily, "kv_cache_usage", "KV-cache blocks in use, as a fraction of all (all replicas)",
                     [], [(key(m), kv_usage(client.stats())) for m, client, _ in per])  # fmt: skip
        yield family(GaugeMetricFamily, "replica_kv_cache_usage", "KV-cache blocks in use, as a fraction", ["replica"],
                     [(key(m) + [r], kv_usage(stats)) for m, _, reps in per for r, stats in reps])  # fmt: skip
        for kind, names in ((GaugeMetricFamily, EngineStats.GAUGES), (CounterMetricFamily, EngineStats.COUNTERS)):
            for name in names:
                yield family(kind, "replica_" + name, HELP[name] + " (per replica)", ["replica"],
                             [(key(m) + [r], getattr(stats, name)) for m, _, reps in per for r, stats in reps])  # fmt: skip
        yield family(CounterMetricFamily, "replica_retries",
                     "sequences sent again because their replica died before producing anything", [],
                     [(key(m), client.retries) for m, client, _ in per])  # fmt: skip
        yield family(CounterMetricFamily, "replica_failures",
                     "sequences ended with a 503 because their replica died while serving them", [],
                     [(key(m), client.replica_failures) for m, client, _ in per])  # fmt: skip
