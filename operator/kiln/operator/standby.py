"""The operator's calls to standby engines (warm pool with sleep): POST /sleep releases a
standby's KV cache while it waits, POST /wake_up allocates it again just before promotion.
Both are best effort: an engine that does not answer is asked again on the next pass, and a
request reaching a sleeping engine wakes it anyway."""
from __future__ import annotations

import json
import logging
import time
import urllib.request

from .render import PORT
from .scrape import in_parallel
from .warmpool import Pod

TIMEOUT_S = 1.0
log = logging.getLogger("kiln.operator")


def call(pod: Pod, path: str, timeout: float = TIMEOUT_S) -> float | None:
    """POST path to the pod's engine; the seconds it took, None if it failed or refused (409:
    requests still in flight, e.g. a pod demoted a moment ago)."""
    started = time.monotonic()
    request = urllib.request.Request(f"http://{pod.ip}:{PORT}{path}", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            json.loads(response.read(1 << 16))
    except Exception as err:  # noqa: BLE001 - refused, timed out, 409, garbage: try again later
        log.debug("POST %s to %s failed: %s", path, pod.name, err)
        return None
    return time.monotonic() - started


def put_to_sleep(pods: list[Pod]) -> list[Pod]:
    """Ask each engine to sleep, at once; those that did."""
    took = in_parallel(lambda p: call(p, "/sleep"), pods)
    return [p for p, t in zip(pods, took) if t is not None]
