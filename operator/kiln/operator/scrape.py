"""Load samples for the builtin autoscaler, read straight from the pods' /metrics (no
Prometheus needed): the engines' queue and the routers' held requests. A pod that does not
answer in time, or answers garbage, gives no number; the caller decides what no number means
(the autoscaler: hold, never zero)."""
from __future__ import annotations

import concurrent.futures
import logging
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .autoscaler import Sample

ENGINE_LOAD = ("kiln:num_requests_waiting", "kiln:num_requests_running")
ROUTER_HELD = ("kiln_router_held_requests",)
TIMEOUT_S = 1.0
log = logging.getLogger("kiln.operator")


def read_metrics(url: str, names: tuple[str, ...], timeout: float = TIMEOUT_S) -> float | None:
    """The sum of every sample of the metric families `names` at `url`; None when the page
    cannot be had, cannot be parsed, or lacks one of them."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read(1 << 20).decode()
        found = {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(text)
                 if f.name in names}
    except Exception as err:  # noqa: BLE001 - timeouts, refusals, garbage: all mean "no number"
        log.debug("scraping %s failed: %s", url, err)
        return None
    if set(found) != set(names):
        return None
    return sum(found.values())


def sample(engines: list[str], routers: list[str], now: float) -> Sample | None:
    """One sample from the ready engine pods' and router pods' metrics URLs. None when no
    router answered (its held requests are the load at zero) or engines exist and none did.
    Engines that did not answer count at the average of those that did, never at zero."""
    urls = [(u, ENGINE_LOAD) for u in engines] + [(u, ROUTER_HELD) for u in routers]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        values = list(pool.map(lambda pair: read_metrics(*pair), urls))
    engine_values = [v for v in values[:len(engines)] if v is not None]
    router_values = [v for v in values[len(engines):] if v is not None]
    if not router_values or (engines and not engine_values):
        return None
    engine_load = sum(engine_values) / len(engine_values) * len(engines) if engines else 0.0
    return Sample(now, engine_load + sum(router_values))
