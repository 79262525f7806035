"""Control-plane faults under a prober, as Knative's HA suite runs them: clients stream
completions through the InferenceService's router Service the whole time and every answer is
counted, while the operator is killed again and again across a create, a revision change and a
scale, a router pod is deleted gracefully and then killed abruptly (two router replicas), and an
engine pod is deleted mid-stream. Then: no duplicate or orphaned children, and deleting the
InferenceService is not held up by a finalizer.

The local cluster has no kube-proxy: `Routers` stands in for it (a mock of that one part),
following the router Service's EndpointSlices and spreading requests over its ready pods. Like a
client library, the prober sends a request again when its connection was refused or never made
(nothing reached a router); those are counted apart."""
from __future__ import annotations

import collections
import json
import os
import random
import signal
import threading
import time

import kubernetes
import openai
import pytest
import yaml

from e2e_support import LOAD_TIMEOUT, MODEL, REPO, Target, Threads, live_pods, ready
from kiln.local.cluster import free_port
from kiln.local.testing import KubectlError, eventually, reconcile_passes

pytestmark = pytest.mark.timeout(1800)
NAME = "faults"


class Routers(Threads):
    """kube-proxy stand-in: the router Service's ready endpoints, re-read every 0.2 s."""

    def __init__(self, target: Target, namespace: str) -> None:
        self.api = kubernetes.client.DiscoveryV1Api(kubernetes.config.new_client_from_config(str(target.kubeconfig)))
        self.namespace, self.ready, self.turn = namespace, [], 0
        super().__init__()

    def _run(self, _: int) -> None:
        while not self.stop.wait(0.2):
            try:
                found = self.api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=f"kubernetes.io/service-name={NAME}", _request_timeout=5).items
            except Exception:  # noqa: BLE001 - an API hiccup: keep the last view, as kube-proxy does
                continue
            self.ready = [f"http://{e.addresses[0]}:{p.port}" for s in found for p in s.ports or [] if p.name == "http"
                          for e in s.endpoints or [] if e.conditions and e.conditions.ready]

    def next(self) -> str | None:
        ready = self.ready
        if not ready:
            return None
        self.turn += 1
        return ready[self.turn % len(ready)]


class Prober(Threads):
    """Clients streaming completions through `routers` until stopped; outcomes per phase."""

    def __init__(self, routers: Routers, clients: int = 3, max_tokens: int = 8) -> None:
        self.routers, self.max_tokens = routers, max_tokens
        self.phase = "start"
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failures: dict[str, list[str]] = collections.defaultdict(list)
        self.clients: dict[str, openai.OpenAI] = {}
        self.in_flight: collections.Counter = collections.Counter()  # per phase, requests not ended yet
        self.lock = threading.Lock()
        super().__init__(clients)

    def _client(self, url: str) -> openai.OpenAI:
        if url not in self.clients:
            self.clients[url] = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return self.clients[url]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            url = self.routers.next()
            if url is None:
                self.stop.wait(0.05)
                continue
            n += 1
            with self.lock:
                phase = self.phase
                self.in_flight[phase] += 1
            try:
                self._send(url, phase, f"Note {i}.{n}: the weather")
            finally:
                with self.lock:
                    self.in_flight[phase] -= 1

    def _send(self, url: str, phase: str, prompt: str) -> None:
        try:
            stream = self._client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens,
                                                          stream=True)
            finish = [c.choices[0].finish_reason for c in stream][-1]
            if finish not in ("length", "stop"):
                raise RuntimeError(f"finish_reason={finish}")
            self.counts[phase]["ok"] += 1
        except openai.APIConnectionError as exc:
            # The HTTP library's ConnectError/ConnectTimeout (openai's transport; named, not imported).
            if type(exc.__cause__).__name__ in ("ConnectError", "ConnectTimeout"):
                self.counts[phase]["reconnected"] += 1  # nothing was sent: a client sends it again
            else:
                self._failed(phase, url, exc)
        except Exception as exc:  # noqa: BLE001 - any other failure is what this test counts
            self._failed(phase, url, exc)

    def _failed(self, phase: str, url: str, exc: Exception) -> None:
        self.counts[phase]["failed"] += 1
        self.failures[phase].append(f"{time.strftime('%H:%M:%S')} {url}: {exc!r} <- {exc.__cause__!r}")

    def enter(self, phase: str) -> None:
        """Count new requests under `phase`, once those of the phase before have all ended: a
        request is counted under the fault it lived through, not the next one (an abrupt kill
        cutting a stream sent before it was counted against the graceful deletion)."""
        with self.lock:
            previous, self.phase = self.phase, phase
        eventually(lambda: self.in_flight[previous] == 0, f"the requests sent during {previous!r} to end", timeout=180)

    def report(self, phase: str, min_success: float) -> None:
        c = self.counts[phase]
        sent = c["ok"] + c["failed"]
        rate = c["ok"] / sent if sent else 0.0
        print(f"{phase}: {sent} requests, {c['failed']} failed ({100 * rate:.2f}% answered), "
              f"{c['reconnected']} sent again after a refused connection")
        for failure in self.failures[phase]:
            print("  failed:", failure)
        assert sent >= 20, f"{phase}: too few requests to judge ({sent})"
        assert rate >= min_success, f"{phase}: {self.failures[phase][:5]}"


def get(target: Target, namespace: str, *what: str) -> dict:
    return json.loads(target.kubectl("get", "-n", namespace, "-o", "json", *what))


def pods(target: Target, namespace: str, component: str) -> list[dict]:
    return live_pods(target, namespace, NAME, component)


def apply(target: Target, namespace: str, replicas: int, max_num_seqs: int) -> None:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = NAME
    body["spec"].update(replicas=replicas, router={"replicas": 2})
    body["spec"]["engine"]["maxNumSeqs"] = max_num_seqs
    target.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))


def settled(target: Target, namespace: str, engines: int) -> bool:
    """Ready, one revision, `engines` ready engine pods and two ready routers, nothing terminating."""
    status = get(target, namespace, "isvc", NAME).get("status") or {}
    ok = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
    everything = get(target, namespace, "pods", "-l", f"kiln.dev/inferenceservice={NAME}")["items"]
    return (ok and len(status.get("revisions") or []) == 1 and len(everything) == engines + 2
            and all(ready(p) and not p["metadata"].get("deletionTimestamp") for p in everything))


class OperatorKiller(Threads):
    """SIGKILLs the operator at random moments of its work and starts it again a second later.
    One it started is killed `low` to `high` seconds after its first reconcile pass began, not after
    its process started: on a busy CPU an operator takes longer than that to start, and a clock
    from the start let none reconcile for minutes at a time (a phase then waited on luck)."""

    def __init__(self, operator, namespace: str, low: float, high: float) -> None:
        self.operator, self.namespace, self.low, self.high, self.kills = operator, namespace, low, high, 0
        self.port = free_port()
        super().__init__()

    def _run(self, _: int) -> None:
        self.operator.restart("--metrics-port", str(self.port), interval=5)  # the fixture's serves no /metrics
        while self._until_it_reconciles() and not self.stop.wait(random.uniform(self.low, self.high)):
            self.operator.stop(signal.SIGKILL)
            self.kills += 1
            time.sleep(1.0)
            self.operator.start("--metrics-port", str(self.port), interval=5)

    def _until_it_reconciles(self) -> bool:
        """Wait (120 s at most) for the operator's first pass over the InferenceService; False once stopped."""
        deadline = time.monotonic() + 120
        while not self.stop.wait(0.2) and time.monotonic() < deadline:
            try:
                if sum(reconcile_passes(self.port, self.namespace, NAME).values()) > 0:
                    break
            except OSError:  # not serving /metrics yet
                continue
        return not self.stop.is_set()


def check_children(target: Target, namespace: str) -> None:
    """One router Deployment and one engine Deployment (one revision), each owned by the
    InferenceService alone; its Services likewise; nothing else labelled for it."""
    uid = get(target, namespace, "isvc", NAME)["metadata"]["uid"]
    for kind, want in (("deployments", 2), ("services", 2), ("poddisruptionbudgets", 2), ("networkpolicies", 2)):
        found = get(target, namespace, kind, "-l", f"kiln.dev/inferenceservice={NAME}")["items"]
        assert len(found) == want, f"{kind}: {[o['metadata']['name'] for o in found]}"
        for obj in found:
            refs = obj["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs] == [uid], f"{kind}/{obj['metadata']['name']}: {refs}"


def router_pid(target: Target, namespace: str, pod: str) -> int:
    """The router process the local test runtime started for this pod (its log names the pid)."""
    log = (target.cluster.dir / "logs" / "runtime.log").read_text().splitlines()
    line = [entry for entry in log if f"started {namespace}/{pod} (pid " in entry][-1]
    return int(line.split("(pid ")[1].split(")")[0])


def test_the_service_keeps_answering_through_control_plane_faults(target: Target, namespace: str, operator) -> None:
    if target.cluster is None:  # it kills the local operator and router processes
        pytest.skip("needs the local cluster: the operator runs as this test's process there")
    with Routers(target, namespace) as routers, Prober(routers) as prober:
        with OperatorKiller(operator, namespace, 0.5, 6) as killer:
            prober.enter("operator kills: create")  # held by the router until the first engine is ready
            apply(target, namespace, replicas=1, max_num_seqs=32)
            eventually(lambda: settled(target, namespace, 1) and prober.counts[prober.phase]["ok"] >= 20,
                       "created and settled", timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
            prober.enter("operator kills: revision change")
            apply(target, namespace, replicas=1, max_num_seqs=24)
            eventually(lambda: settled(target, namespace, 1) and prober.counts[prober.phase]["ok"] >= 20,
                       "the new revision alone", timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
            prober.enter("operator kills: scale")
            apply(target, namespace, replicas=2, max_num_seqs=24)
            eventually(lambda: settled(target, namespace, 2) and prober.counts[prober.phase]["ok"] >= 20,
                       "scaled to 2", timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
        print(f"operator killed {killer.kills} times")
        assert killer.kills >= 3
        check_children(target, namespace)

        prober.enter("router deleted gracefully")
        victim = pods(target, namespace, "router")[0]["metadata"]["name"]
        target.kubectl("delete", "pod", "-n", namespace, victim, "--wait=true", timeout=120)
        eventually(lambda: settled(target, namespace, 2) and prober.counts[prober.phase]["ok"] >= 20,
                   "two routers again", timeout=300, ignore=(KubectlError,))

        prober.enter("router killed abruptly")
        # Short answers: a kill cuts the streams in flight, as many whatever their length (each client
        # has one), and the 400 below, for one failure in a hundred to mean something, come sooner.
        prober.max_tokens = 2
        victim = pods(target, namespace, "router")[0]["metadata"]["name"]
        os.kill(router_pid(target, namespace, victim), signal.SIGKILL)  # a crash: the runtime restarts it
        eventually(lambda: prober.counts[prober.phase]["ok"] >= 400 and settled(target, namespace, 2),
                   "both routers serving again", timeout=300, ignore=(KubectlError,))

        prober.enter("engine deleted mid-stream")
        prober.max_tokens = 48  # streams long enough to be cut if the drain failed
        eventually(lambda: prober.counts[prober.phase]["ok"] >= 3, "long streams flowing", timeout=120)
        victim = pods(target, namespace, "engine")[0]["metadata"]["name"]
        target.kubectl("delete", "pod", "-n", namespace, victim, "--wait=true", timeout=300)
        eventually(lambda: settled(target, namespace, 2) and prober.counts[prober.phase]["ok"] >= 20,
                   "a replacement engine serving", timeout=LOAD_TIMEOUT, ignore=(KubectlError,))
    try:
        for phase in ("operator kills: create", "operator kills: revision change", "operator kills: scale",
                      "engine deleted mid-stream"):
            prober.report(phase, 1.0)
        prober.report("router killed abruptly", 0.99)
        prober.report("router deleted gracefully", 1.0)
    except AssertionError:
        for log in sorted((target.cluster.dir / "logs" / "pods").glob(f"{namespace}_{NAME}-router-*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-15:]))
        runtime = (target.cluster.dir / "logs" / "runtime.log").read_text().splitlines()
        print("---- runtime log ----\n" + "\n".join(line for line in runtime if namespace in line))
        raise
    check_children(target, namespace)

    target.kubectl("delete", "isvc", NAME, "-n", namespace, "--wait=true", timeout=90)  # no finalizer holds it
    eventually(lambda: not get(target, namespace, "deployments", "-l", f"kiln.dev/inferenceservice={NAME}")["items"],
               "its children garbage-collected", timeout=120, ignore=(KubectlError,))
