"""The operator's own Prometheus metrics (`kiln operator --metrics-port`): its passes, and what
its warm pools do and cost. Module-level, as the operator is one process; the routers and engines measure the
request path."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

# "fresh": read the object and its children from the API server; "reused": a timer pass that reused
# the last read (reconcile.reconcile), so its only API calls were writes.
PASSES = Counter("kiln_operator_reconcile_passes", "Reconcile passes, by what they read",
                 ["namespace", "inferenceservice", "read"])
PROMOTIONS = Counter("kiln_operator_warm_pool_promotions", "Standby pods promoted to serving",
                     ["namespace", "inferenceservice"])
# The operator's side of a promotion: the pod patch. Routing follows once the EndpointSlice updates.
PROMOTION_SECONDS = Histogram("kiln_operator_warm_pool_promotion_seconds", "Time to promote a standby pod",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
IDLE_GPU_SECONDS = Counter("kiln_operator_warm_pool_idle_gpu_seconds",
                           "GPU-seconds standbys spent ready and unrouted (what the pool costs)",
                           ["namespace", "inferenceservice"])


def forget(namespace: str, name: str) -> None:
    """An InferenceService is gone: its series go too (kube-state-metrics does the same)."""
    for read in ("fresh", "reused"):
        PASSES.remove(namespace, name, read)
    PROMOTIONS.remove(namespace, name)
    IDLE_GPU_SECONDS.remove(namespace, name)

