"""The builtin autoscaler on the whole system: real engines and routers (the local cluster's test
runtime), the operator scraping their /metrics. Windows are short so the suite stays fast.

- a burst of concurrent long requests scales a min 1 / max 3 service to 3, not one request
  fails, replicas never drop while the burst lasts (not even across an operator killed in the
  middle of it), and it returns to 1 once the load stops;
- a min 0 service goes to zero and stays there without traffic (no flapping), and meanwhile the
  operator's timer passes reuse their last read instead of calling the API server; a request
  sent then is held by the router and answered with the engine's greedy text.
"""
from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import openai
import pytest
import yaml

from e2e_support import LOAD_TIMEOUT, MODEL, PROMPT, REPO, Load, Target, Threads
from kiln.local.cluster import free_port
from kiln.local.testing import KubectlError, OperatorProcess, eventually
from kiln.local.testing import reconcile_passes as passes

pytestmark = pytest.mark.timeout(1800)
WINDOWS = {"stableWindow": "10s", "panicWindow": "4s"}


def apply(target: Target, namespace: str, name: str, autoscaling: dict) -> None:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = name
    body["spec"]["autoscaling"] = {"mode": "builtin", **WINDOWS, **autoscaling}
    target.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))


def isvc(target: Target, namespace: str, name: str) -> dict:
    return json.loads(target.kubectl("get", "isvc", name, "-n", namespace, "-o", "json"))


def engine_replicas(target: Target, namespace: str, name: str) -> int:
    """What the engine Deployments ask for (the autoscaler's decisions as applied)."""
    found = json.loads(target.kubectl("get", "deployments", "-n", namespace, "-o", "json", "-l",
                                      f"kiln.dev/inferenceservice={name},kiln.dev/component=engine"))
    return sum(d["spec"].get("replicas", 1) for d in found["items"])


def scaled_events(target: Target, namespace: str, name: str) -> list[str]:
    found = json.loads(target.kubectl("get", "events", "-n", namespace, "-o", "json", "--field-selector",
                                      f"involvedObject.name={name},reason=Scaled"))
    return [e["message"] for e in found["items"]]


def ready_replicas(target: Target, namespace: str, name: str) -> int:
    return (isvc(target, namespace, name).get("status") or {}).get("readyReplicas", 0)


def wait_ready(target: Target, namespace: str, name: str) -> None:
    target.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"--timeout={LOAD_TIMEOUT}s",
                   f"inferenceservice/{name}", timeout=LOAD_TIMEOUT + 30)


class Watch(Threads):
    """The engine Deployments' replicas, sampled until stopped."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read, self.seen = read, []
        super().__init__()

    def _run(self, _: int) -> None:
        while not self.stop.wait(0.5):
            try:
                self.seen.append(self.read())
            except KubectlError:
                pass


def test_a_burst_scales_out_and_back_without_losing_a_request(target: Target, namespace: str,
                                                               operator: OperatorProcess | None, base_url) -> None:
    name = "burst"
    apply(target, namespace, name, {"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2,
                                    "scaleDownDelay": "20s"})
    wait_ready(target, namespace, name)
    url = base_url(name)
    with Watch(lambda: engine_replicas(target, namespace, name)) as watch, Load(url, clients=8) as load:
        eventually(lambda: ready_replicas(target, namespace, name) >= 2, "a second replica serving",
                   timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
        if operator is not None:  # killed in the middle of the burst: no scale-down, no flapping
            operator.restart(sig=signal.SIGKILL, interval=5)
        eventually(lambda: ready_replicas(target, namespace, name) == 3, "3 replicas serving",
                   timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
        eventually(lambda: load.done >= 16, "requests served by the scaled-out service", timeout=300)
    assert not load.failures, f"{len(load.failures)} requests failed: {load.failures[:3]}"
    assert max(watch.seen) == 3 and watch.seen == sorted(watch.seen), f"replicas dropped mid-burst: {watch.seen}"
    status = isvc(target, namespace, name)["status"]
    assert status["autoscaling"]["load"] > 0 and status["desiredReplicas"] == 3
    # The load is gone: back to minReplicas after the scale-down delay.
    eventually(lambda: engine_replicas(target, namespace, name) == 1, "back to 1 replica", timeout=240,
               ignore=(KubectlError,))
    assert len(scaled_events(target, namespace, name)) >= 3  # 1->2, 2->3, 3->1 at least


def ready_condition(target: Target, namespace: str, name: str) -> tuple[str, str]:
    ready = next(c for c in isvc(target, namespace, name)["status"]["conditions"] if c["type"] == "Ready")
    return ready["status"], ready["reason"]


def test_scale_to_zero_stays_there_and_the_first_request_is_held_and_answered(
        target: Target, namespace: str, operator: OperatorProcess | None, base_url, reference) -> None:
    name = "sleepy"
    port = free_port()
    if operator is not None:  # the local one: with its metrics served, to count its passes
        operator.restart(f"--metrics-port={port}", interval=5)
    apply(target, namespace, name, {"minReplicas": 0, "maxReplicas": 2, "targetQueueDepth": 4,
                                    "scaleDownDelay": "10s"})
    wait_ready(target, namespace, name)
    url = base_url(name)
    eventually(lambda: engine_replicas(target, namespace, name) == 0, "scale to zero", timeout=180,
               ignore=(KubectlError,))
    # The replica count drops before the operator's next status write says why: wait for that write.
    eventually(lambda: ready_condition(target, namespace, name) == ("True", "ScaledToZero"),
               "Ready True with reason ScaledToZero", timeout=60, ignore=(KubectlError, StopIteration))
    # No traffic for several stable windows: nothing moves (KubeAI #67 went 0->1->0 twelve times).
    events = scaled_events(target, namespace, name)
    before = passes(port, namespace, name) if operator is not None else {}
    time.sleep(25)
    assert engine_replicas(target, namespace, name) == 0 and scaled_events(target, namespace, name) == events
    if operator is not None:
        # Passes every 0.5 s at zero; only a watch event or the resync (every 5 s here) reads afresh.
        # Counted until 20 passes reused a read (a loaded machine runs fewer passes in the 25 s).
        after = eventually(lambda: (a := passes(port, namespace, name)).get("reused", 0) - before.get("reused", 0)
                           >= 20 and a, "20 passes that reused a read", timeout=60)
        fresh, reused = (after.get(k, 0) - before.get(k, 0) for k in ("fresh", "reused"))
        assert fresh <= reused / 3, (fresh, reused)

    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=LOAD_TIMEOUT)
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert completion.choices[0].text == reference["completion"]  # held, then answered by a fresh replica
    cold = eventually(lambda: (isvc(target, namespace, name)["status"].get("autoscaling") or {})
                      .get("lastColdStartSeconds"), "the cold start in status", timeout=60, ignore=(KubectlError,))
    assert cold > 0
