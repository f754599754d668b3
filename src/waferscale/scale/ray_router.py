"""Ray Serve's custom request router (alpha API, ray.serve.request_router) running our prefix-affinity routing.

It runs inside each front's deployment handle: the replicas it is offered are Serve's live ones (a dead replica is
dropped as soon as a call to it fails), their loads the `waiting` figure each reports through Serve's routing
stats. It returns one rank per replica in the key's order; Serve tries them in turn, skipping a replica whose
queue of calls is full."""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from waferscale.scale.routing import route


class AffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if not key or not candidate_replicas:  # calls without a key (describe): any replica, least busy first
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {i: float((r.routing_stats or {}).get("waiting", 0)) for i, r in by_id.items()}
        return [[by_id[i]] for i in route(key, loads)]
