"""Load samples for the builtin autoscaler, read straight from the pods' /metrics (no
Prometheus needed): the engines' queue and the routers' held requests. A pod that does not
answer in time, or answers garbage, gives no number; the caller decides what no number means
(the autoscaler: hold, never zero)."""
from __future__ import annotations

import concurrent.futures
import logging
import math
import urllib.request
from dataclasses import dataclass
from typing import Callable, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from .autoscaler import Sample

ENGINE_LOAD = ("kiln:num_requests_waiting", "kiln:num_requests_running")
ROUTER_HELD = "kiln_router_held_requests"  # waiting for a replica (none ready)
ROUTER_QUEUED = "kiln_router_queued_requests"  # waiting for a place among the router's --max-in-flight
ROUTER_COLD_START = "kiln_router_last_cold_start_seconds"
ROUTER_COLD_START_TIME = "kiln_router_last_cold_start_timestamp_seconds"
TIMEOUT_S = 1.0
log = logging.getLogger("kiln.operator")
T, R = TypeVar("T"), TypeVar("R")


@dataclass(frozen=True)
class Scrape:
    sample: Sample | None  # None: not enough answered to know the load
    cold_start: float | None  # the routers' latest request-held-to-first-byte, if any


def read_samples(url: str, timeout: float = TIMEOUT_S) -> list[tuple[str, dict[str, str], float]] | None:
    """Every sample at `url` as (name, labels, value); None when the page cannot be had or parsed."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read(1 << 20).decode()
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    except Exception as err:  # noqa: BLE001 - timeouts, refusals, garbage: all mean "no number"
        log.debug("scraping %s failed: %s", url, err)
        return None


def totals(samples: list[tuple[str, dict[str, str], float]] | None) -> dict[str, float] | None:
    """Each sample name's values summed over their labels."""
    if samples is None:
        return None
    sums: dict[str, float] = {}
    for name, _, value in samples:
        sums[name] = sums.get(name, 0.0) + value
    return sums


def count(value: float) -> bool:
    """A number of requests: NaN, an infinity or a negative value is garbage, the same as no
    answer (a NaN sample would stop every decision until it aged out of the window)."""
    return math.isfinite(value) and value >= 0


def in_parallel(call: Callable[[T], R], items: list[T]) -> list[R]:
    """call(item) for each item, at once (pods are slow one by one: a timeout each)."""
    if not items:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(call, items))


def read_all(urls: list[str], timeout: float = TIMEOUT_S) -> list[list[tuple[str, dict[str, str], float]] | None]:
    """read_samples of each URL, at once."""
    return in_parallel(lambda url: read_samples(url, timeout), urls)


def scrape(engines: list[str], routers: list[str], now: float) -> Scrape:
    """One sample from the ready engine pods' and router pods' metrics URLs. No sample when no
    router answered (its held requests are the load at zero) or engines run and none answered.
    Engines that did not answer count at the average of those that did, never at zero; so do
    routers (a slow router's backlog must not read as none)."""
    urls = engines + routers
    pages = [totals(samples) for samples in read_all(urls)]
    loads = [sum(p[n] for n in ENGINE_LOAD) for p in pages[:len(engines)]
             if p is not None and all(n in p and count(p[n]) for n in ENGINE_LOAD)]
    # Requests a router holds or queues are demand the engines have not seen yet.
    held = [p[ROUTER_HELD] + p.get(ROUTER_QUEUED, 0.0) for p in pages[len(engines):]
            if p is not None and ROUTER_HELD in p and count(p[ROUTER_HELD]) and count(p.get(ROUTER_QUEUED, 0.0))]
    # The newest router's (one router's old slow start must not stand for every later one).
    cold = [(p.get(ROUTER_COLD_START_TIME, 0.0), p[ROUTER_COLD_START]) for p in pages[len(engines):]
            if p and p.get(ROUTER_COLD_START) and count(p[ROUTER_COLD_START])
            and math.isfinite(p.get(ROUTER_COLD_START_TIME, 0.0))]  # NaN: a status the API server refuses
    cold_start = max(cold)[1] if cold else None
    if not held or (engines and not loads):
        return Scrape(None, cold_start)
    # Multiplied before dividing: with every pod answering the sum comes back exact (116 / 7 * 7
    # is 116.00000000000001, and ceil() ordered a replica more at an exact multiple of the target).
    engine_load = sum(loads) * len(engines) / len(loads) if engines else 0.0
    return Scrape(Sample(now, engine_load + sum(held) * len(routers) / len(held)), cold_start)
