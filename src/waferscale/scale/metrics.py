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
    """Reads the Ray client's latest per-replica stats at every scrape."""

    def __init__(self, client):
        self.client = client

    def collect(self):
        replicas = self.client.per_replica()
        yield GaugeMetricFamily(PREFIX + "replicas", "engine replicas reporting", value=len(replicas))
        info = GaugeMetricFamily(
            PREFIX + "replica_info", "an engine replica: its Ray node and process id", labels=["replica", "node", "pid"]
        )
        for replica, report in sorted(self.client.replicas.items()):
            info.add_metric([replica, str(report.get("node", "")), str(report.get("pid", ""))], 1)
        yield info
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_usage", "KV-cache blocks in use, as a fraction of all (all replicas)",
            value=kv_usage(self.client.stats()),
        )
        usage = GaugeMetricFamily(
            PREFIX + "replica_kv_cache_usage", "KV-cache blocks in use, as a fraction", labels=["replica"]
        )
        for replica, stats in sorted(replicas.items()):
            usage.add_metric([replica], kv_usage(stats))
        yield usage
        for kind, names in ((GaugeMetricFamily, EngineStats.GAUGES), (CounterMetricFamily, EngineStats.COUNTERS)):
            for name in names:
                family = kind(PREFIX + "replica_" + name, HELP[name] + " (per replica)", labels=["replica"])
                for replica, stats in sorted(replicas.items()):
                    family.add_metric([replica], getattr(stats, name))
                yield family
        yield CounterMetricFamily(
            PREFIX + "replica_retries",
            "sequences sent again because their replica died before producing anything",
            value=self.client.retries,
        )
        yield CounterMetricFamily(
            PREFIX + "replica_failures",
            "sequences ended with a 503 because their replica died while serving them",
            value=self.client.replica_failures,
        )
