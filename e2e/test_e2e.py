"""The whole system: kubectl apply an InferenceService, and SmolLM2 answers through its router.

The steps are what the README's "Try it" shows: apply examples/smollm2.yaml, wait for Ready,
ask for completions and chat (greedy text must equal the engine's own, computed here
in-process), scale to two replicas through the scale subresource and see the router spread
traffic over both, delete an engine pod under load without losing a request that had not
started streaming, delete the InferenceService and see everything it made go. Each test gets
the InferenceService into the state it starts from (the `serving` fixture), so any one runs
alone or in any order (in file order, most find it as the test before left it).
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_support import CHAT, LOAD_TIMEOUT, MODEL, PROMPT, REPO, Target
from kiln.local.testing import KubectlError, eventually

NAME = "smollm2"
LABEL = f"kiln.dev/inferenceservice={NAME}"

pytestmark = pytest.mark.timeout(1800)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except (urllib.error.URLError, OSError):
        return False
    return True


def finished_per_pod(target: Target, namespace: str) -> Counter:
    """Requests each engine pod finished, from its own /metrics, read through the API server's
    pod proxy (so it works on any cluster, port-forward or not)."""
    counts: Counter = Counter()
    for pod in engine_pods(target, namespace):
        name = pod["metadata"]["name"]
        text = target.kubectl("get", "--raw", f"/api/v1/namespaces/{namespace}/pods/{name}:8000/proxy/metrics")
        for family in text_string_to_metric_families(text):
            counts[name] += sum(s.value for s in family.samples if s.name == "kiln:request_success_total")
    return counts


def engine_pods(target: Target, namespace: str) -> list[dict]:
    out = target.kubectl("get", "pods", "-n", namespace, "-l", f"{LABEL},kiln.dev/component=engine", "-o", "json")
    return json.loads(out)["items"]


@pytest.fixture(scope="module")
def serving(target: Target, namespace: str, operator: None, base_url) -> Callable[..., str]:
    """serving(replicas=None) -> the router's URL, once examples/smollm2.yaml is applied (a no-op
    when it is already), scaled to `replicas` engines if given, Ready, and there are exactly that
    many engine pods, all known to the router (without replicas: the router knows at least one)."""
    def serve(replicas: int | None = None) -> str:
        target.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples/smollm2.yaml"))
        if replicas is not None:
            target.kubectl("scale", "-n", namespace, f"inferenceservice/{NAME}", f"--replicas={replicas}")
        target.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"--timeout={LOAD_TIMEOUT}s",
                       f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)
        if replicas is not None:
            target.kubectl("wait", "-n", namespace, f"--for=jsonpath={{.status.readyReplicas}}={replicas}",
                           f"--timeout={LOAD_TIMEOUT}s", f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)
        url = base_url(NAME)

        def settled() -> bool:
            endpoints = get_json(url + "/ready")["endpoints"]
            return endpoints > 0 if replicas is None else endpoints == replicas == len(engine_pods(target, namespace))
        eventually(settled, f"{replicas or 'a'} ready engine(s), known to the router", timeout=180,
                   ignore=(OSError, KubectlError))
        return url
    return serve


def test_apply_becomes_ready_with_useful_columns(target: Target, namespace: str, serving) -> None:
    url = serving(1)
    table = target.kubectl("get", "isvc", "-n", namespace).splitlines()
    assert table[0].split()[:5] == ["NAME", "READY", "REASON", "REPLICAS", "MODEL"]
    assert table[1].split()[:5] == [NAME, "True", "Serving", "1", MODEL]
    # The user-facing Service leads to the router, which knows one ready engine.
    assert get_json(url + "/ready")["endpoints"] == 1


def test_completions_and_chat_are_answered_by_smollm2(serving, reference) -> None:
    api = client(serving())
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert completion.choices[0].text == reference["completion"]
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == reference["chat"]
    assert "Paris" in chat.choices[0].message.content


def test_scale_to_two_spreads_traffic_over_both(target: Target, namespace: str, serving) -> None:
    url = serving(1)
    target.kubectl("scale", "-n", namespace, f"inferenceservice/{NAME}", "--replicas=2")
    target.kubectl("wait", "-n", namespace, "--for=jsonpath={.status.readyReplicas}=2", f"--timeout={LOAD_TIMEOUT}s",
                   f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)
    eventually(lambda: get_json(url + "/ready")["endpoints"] == 2, "the router to know both engines", timeout=120,
               ignore=(OSError,))
    before = finished_per_pod(target, namespace)
    api = client(url)
    threads = [threading.Thread(target=api.completions.create,
                                kwargs={"model": MODEL, "prompt": f"{i} plus {i} is", "max_tokens": 16})
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = finished_per_pod(target, namespace) - before
    pods = {p["metadata"]["name"] for p in engine_pods(target, namespace)}
    assert set(served) == pods, f"requests per engine: {dict(served)}; engine pods: {pods}"
    assert sum(served.values()) == 8


@dataclass
class Outcome:
    streamed: bool  # the first token had arrived before anything went wrong
    ok: bool
    error: str = ""


def stream_until(api: openai.OpenAI, stop: threading.Event, outcomes: list[Outcome]) -> None:
    while not stop.is_set():
        streamed = False
        try:
            stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, stream=True)
            finish = None
            for chunk in stream:
                streamed = True
                finish = chunk.choices[0].finish_reason or finish
            outcomes.append(Outcome(streamed, finish in ("length", "stop"), f"finish_reason={finish}"))
        except (openai.APIError, urllib.error.URLError, OSError) as exc:
            outcomes.append(Outcome(streamed, False, repr(exc)))


def test_deleting_an_engine_pod_under_load_loses_no_request(target: Target, namespace: str, serving) -> None:
    api = client(serving(2))  # another engine to take over
    victim = engine_pods(target, namespace)[0]["metadata"]["name"]
    stop, outcomes = threading.Event(), []
    workers = [threading.Thread(target=stream_until, args=(api, stop, outcomes)) for _ in range(4)]
    for w in workers:
        w.start()
    eventually(lambda: len(outcomes) >= 4, "load to flow", timeout=120)
    target.kubectl("delete", "pod", "-n", namespace, victim, "--wait=false")
    # Past the preStop pause and the drain: the pod's engine is gone by then.
    eventually(lambda: victim not in {p["metadata"]["name"] for p in engine_pods(target, namespace)}, "pod deletion",
               timeout=120, ignore=(KubectlError,))
    gone_at = len(outcomes)
    # Traffic goes on once the pod is gone (waited for: the replacement's load shares the CPUs).
    eventually(lambda: len(outcomes) > gone_at + 4, "requests served after the pod was gone", timeout=300)
    stop.set()
    for w in workers:
        w.join()
    lost = [o for o in outcomes if not o.ok and not o.streamed]
    assert not lost, f"{len(lost)} of {len(outcomes)} requests failed before streaming: {lost[:3]}"
    broken = [o for o in outcomes if not o.ok]
    assert not broken, f"streams broken off mid-way: {broken[:3]}"  # the engine drained them


def test_deleting_the_service_removes_everything(target: Target, namespace: str, serving) -> None:
    url = serving()
    uids = [p["metadata"]["uid"] for p in engine_pods(target, namespace)]
    target.kubectl("delete", "-n", namespace, f"inferenceservice/{NAME}", "--timeout=120s")
    kinds = ("deployments,replicasets,pods,services,endpointslices,poddisruptionbudgets,serviceaccounts,rolebindings,"
             "horizontalpodautoscalers")

    def leftovers() -> str:
        return target.kubectl("get", kinds, "-n", namespace, "-l", LABEL, "-o", "name").strip()
    eventually(lambda: leftovers() == "", "every child to be garbage-collected", timeout=180, ignore=(KubectlError,))
    eventually(lambda: not answers(url + "/health"), "the router to stop answering", 60)
    if target.cluster is not None:  # the test runtime stopped the pods' processes and namespaces
        net = target.cluster.network()
        eventually(lambda: not {f"p{u[:8]}" for u in uids} & set(net.namespaces()), "pod namespaces to go", 60)
