"""Warm pools on the whole system: real engines and a real router on the local cluster, the
builtin autoscaler deciding. No client request may fail.

- with `warmPool: {size: 1, sleep: true}` the standby is Ready (loaded, warmed), asleep (its KV cache released)
  and gets none of 100 requests;
- a load step promotes it: it answers routed requests while its replacement standby is still
  loading (a cold start would only begin there);
- scaled to zero serving replicas with the standby kept, the first request is answered by that
  standby, woken and promoted (no cold start: the pod that answers was Ready before it came).
Answers are greedy and must be the engine's own, computed in-process (the `reference` fixture)."""
from __future__ import annotations

import datetime
import json
import time
import urllib.request
from collections import Counter

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e_support import LOAD_TIMEOUT, MODEL, PROMPT, REPO, Load, Target, live_pods, ready
from kiln.local.testing import KubectlError, eventually

pytestmark = pytest.mark.timeout(1800)
NAME = "warm"


def apply(target: Target, namespace: str, min_replicas: int) -> None:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = NAME
    body["spec"]["warmPool"] = {"size": 1, "sleep": True}
    body["spec"]["autoscaling"] = {"mode": "builtin", "minReplicas": min_replicas, "maxReplicas": 2,
                                   "targetQueueDepth": 2, "stableWindow": "10s", "panicWindow": "4s",
                                   "scaleDownDelay": "10s"}
    target.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))


def pods(target: Target, namespace: str) -> list[dict]:
    return live_pods(target, namespace, NAME, "engine")


def role(pod: dict) -> str:
    return pod["metadata"]["labels"].get("kiln.dev/serving", "")


def served(pod: dict) -> float:
    """Requests the engine in this pod has finished (from its own /metrics)."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kiln:e2e_request_latency_seconds_count")


def asleep(pod: dict) -> bool:
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/is_sleeping", timeout=10) as response:
        return json.loads(response.read())["is_sleeping"]


def stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def status(target: Target, namespace: str) -> dict:
    return json.loads(target.kubectl("get", "isvc", NAME, "-n", namespace, "-o", "json")).get("status") or {}


def woken_promotions(target: Target, namespace: str) -> Counter:
    """Pod name -> Promoted Events saying the operator woke and promoted that standby."""
    events = json.loads(target.kubectl("get", "events", "-n", namespace, "-o", "json",
                                       "--field-selector", "reason=Promoted"))["items"]
    return Counter(e["message"].split()[1] for e in events
                   if e["message"].startswith("standby ") and "woken in" in e["message"])


def test_a_standby_takes_nothing_then_serves_at_once_on_a_load_step_and_from_zero(
        target: Target, namespace: str, operator, base_url, reference) -> None:
    apply(target, namespace, min_replicas=1)
    target.kubectl("wait", "-n", namespace, "--for=condition=WarmPoolReady", f"--timeout={LOAD_TIMEOUT}s",
                   f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)
    def one_serving_one_standby() -> list[dict] | None:
        found = pods(target, namespace)
        return found if sorted(role(p) for p in found if ready(p)) == ["false", "true"] else None
    found = eventually(one_serving_one_standby, "1 serving + 1 standby", timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
    standby = next(p for p in found if role(p) == "false")
    eventually(lambda: asleep(standby), "the standby asleep", timeout=60, ignore=(OSError,))
    url = base_url(NAME)
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    before = served(standby)
    for _ in range(100):  # one at a time: a load the serving replica carries alone
        text = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text
        assert text and reference["completion"].startswith(text), (text, reference["completion"])  # greedy's start
    assert served(standby) == before  # never routed

    # A load step: the standby is promoted (the same pod) and serves while its replacement loads.
    name = standby["metadata"]["name"]
    with Load(url, clients=6, max_tokens=16) as load:
        def promoted_serving_during_refill() -> bool:
            now = {p["metadata"]["name"]: p for p in pods(target, namespace)}
            loading = [p for p in now.values() if role(p) == "false" and not ready(p)]
            return name in now and role(now[name]) == "true" and served(now[name]) > before and bool(loading)
        eventually(promoted_serving_during_refill, "the promoted standby serving while the pool refills",
                   timeout=LOAD_TIMEOUT, interval=0.2, ignore=(KubectlError, OSError))
        done = load.done
        eventually(lambda: load.done >= done + 6, "more requests served", timeout=300)
    assert not load.failures, f"{len(load.failures)} requests failed: {load.failures[:3]}"
    assert not asleep(next(p for p in pods(target, namespace) if p["metadata"]["name"] == name))
    events = json.loads(target.kubectl("get", "events", "-n", namespace, "-o", "json",
                                       "--field-selector", "reason=Promoted"))["items"]
    assert any(name in e["message"] and "woken in" in e["message"] for e in events), [e["message"] for e in events]
    refill = eventually(lambda: next((p for p in pods(target, namespace) if role(p) == "false" and ready(p)), None),
                        "the pool refilled", timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
    ready_at = next(c["lastTransitionTime"] for c in refill["status"]["conditions"] if c["type"] == "Ready")
    cold = stamp(ready_at) - stamp(refill["metadata"]["creationTimestamp"])  # a replica's cold start
    assert status(target, namespace)["warmPool"]["promotions"] >= 2

    # From zero serving replicas, the standby answers the first request: that very pod, woken and
    # promoted, not a replica started for it.
    apply(target, namespace, min_replicas=0)

    def only_a_sleeping_standby() -> dict | None:
        live = [p for p in pods(target, namespace) if ready(p)]
        return live[0] if status(target, namespace).get("desiredReplicas") == 0 and \
            [(role(p), asleep(p)) for p in live] == [("false", True)] else None
    sleeper = eventually(only_a_sleeping_standby, "zero serving, one standby asleep", timeout=300,
                         ignore=(KubectlError, OSError))
    pod_name, before, promotions = sleeper["metadata"]["name"], served(sleeper), woken_promotions(target, namespace)
    started = time.monotonic()
    answer = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    warm = time.monotonic() - started
    assert answer.choices[0].text == reference["completion"]
    # The standby's own engine finished it: no replica was started to serve it...
    eventually(lambda: served(sleeper) == before + 1, "the standby's engine counting the request it served",
               timeout=30, ignore=(OSError,))
    # ...once the operator had woken and promoted it (this pod may have been promoted before: one more).
    eventually(lambda: woken_promotions(target, namespace)[pod_name] == promotions[pod_name] + 1,
               "a Promoted Event for the standby, woken", timeout=30, ignore=(KubectlError,))
    # Information only: the ratio moves with the machine's load.
    print(f"cold start of a replica {cold:.1f} s; first request from zero with a warm pool {warm:.2f} s")
