"""Canary rollouts on the whole system: real engines and a real router on the local cluster,
the operator analysing what the router measured. Steady client load runs throughout and not
one client request may fail.

- `quantization: none -> int8` with two short steps is promoted (with the operator killed in
  the middle of a step: the restarted one resumes that same step), and int8 then serves 100%;
- `int8 -> int4-rtn` with a quality gate it cannot pass is rolled back on its own: the
  agreement the router measured is in the Warning event and in status, and int8 serves 100%
  again.
Intervals, pauses and sample sizes are short so the suite stays fast."""
from __future__ import annotations

import json
import signal
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e_support import LOAD_TIMEOUT, REPO, Load, Target
from kiln.local.testing import KubectlError, OperatorProcess, eventually

pytestmark = pytest.mark.timeout(1800)
NAME = "canary"
# CPU replicas sharing two cores: int8 decodes slower than float32 here, so latency ratios
# only catch gross regressions; the quality gate is what this test is about.
ANALYSIS = {"interval": "8s", "failureLimit": 3, "minRequests": 2, "maxErrorRate": 0.0,
            "maxTimeToFirstTokenP95Ratio": 20.0, "maxInterTokenLatencyP95Ratio": 20.0,
            "quality": {"sampleRate": 0.5, "floorSampleRate": 0.5, "minTokens": 16, "minGreedyAgreement": 0.8}}


def apply(target: Target, namespace: str, quantization: str, analysis: dict) -> None:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = NAME
    body["spec"]["engine"]["quantization"] = quantization
    # A step goes on once its pause is over and a check passed: pauses of one interval end at the first.
    body["spec"]["rollout"] = {"steps": [{"weight": 30, "pause": "8s"}, {"weight": 60, "pause": "8s"}],
                               "progressDeadline": "10m", "analysis": analysis}
    target.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))


def status(target: Target, namespace: str) -> dict:
    return json.loads(target.kubectl("get", "isvc", NAME, "-n", namespace, "-o", "json")).get("status") or {}


def rollout(target: Target, namespace: str) -> dict:
    return status(target, namespace).get("rollout") or {}


def revisions(target: Target, namespace: str) -> dict[str, dict]:
    return {r["name"]: r for r in status(target, namespace).get("revisions") or []}


def engine_deployments(target: Target, namespace: str) -> set[str]:
    found = json.loads(target.kubectl("get", "deployments", "-n", namespace, "-o", "json", "-l",
                                      f"kiln.dev/inferenceservice={NAME},kiln.dev/component=engine"))
    return {d["metadata"]["name"] for d in found["items"] if not d["metadata"].get("deletionTimestamp")}


def deployment_uid(target: Target, namespace: str, name: str) -> str:
    return json.loads(target.kubectl("get", "deployment", name, "-n", namespace, "-o", "json"))["metadata"]["uid"]


def events(target: Target, namespace: str, reason: str) -> list[dict]:
    found = json.loads(target.kubectl("get", "events", "-n", namespace, "-o", "json", "--field-selector",
                                      f"involvedObject.name={NAME},reason={reason}"))
    return found["items"]


def router_metric(url: str, name: str, **labels: str) -> dict[str, float]:
    """A router metric by revision, among the samples with these labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.labels["revision"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()}


def answered(url: str) -> dict[str, float]:
    """Client requests the router answered with 200, by revision."""
    return router_metric(url, "kiln_router_requests_total", code="200")


def drained(url: str, revision: str) -> bool:
    """The router has no request in flight at the revision (an old one finishing what it had)."""
    return not router_metric(url, "kiln_router_in_flight_requests").get(revision)


def phase(target: Target, namespace: str, wanted: str, timeout: float = LOAD_TIMEOUT) -> dict:
    return eventually(lambda: (r := rollout(target, namespace)).get("phase") == wanted and r, f"rollout {wanted}",
                      timeout=timeout, interval=1, ignore=(KubectlError,))


def test_int8_is_promoted_then_a_failing_int4_rtn_is_rolled_back_without_a_failed_request(
        target: Target, namespace: str, operator: OperatorProcess | None, base_url) -> None:
    apply(target, namespace, "none", ANALYSIS)
    target.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"--timeout={LOAD_TIMEOUT}s",
                   f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)
    (first,) = engine_deployments(target, namespace)
    url = base_url(NAME)
    with Load(url, clients=2, max_tokens=8) as load:
        apply(target, namespace, "int8", ANALYSIS)
        started = eventually(lambda: (r := rollout(target, namespace)).get("canary") and r, "a canary",
                             timeout=60, ignore=(KubectlError,))
        canary = started["canary"]
        assert started["stable"] == first and revisions(target, namespace)[canary]["quantization"] == "int8"
        # Inside step 1 the canary takes its share; kill the operator: the new one resumes the
        # same rollout at the same step (same canary Deployment, its step clock kept).
        during = eventually(lambda: (r := rollout(target, namespace)).get("step") == 1 and r, "step 1",
                            timeout=LOAD_TIMEOUT, interval=1, ignore=(KubectlError,))
        assert revisions(target, namespace)[canary]["weight"] == 30
        uid = deployment_uid(target, namespace, canary)
        if operator is not None:
            operator.restart(sig=signal.SIGKILL, interval=5)
            resumed = eventually(lambda: (r := rollout(target, namespace)).get("step", 0) >= 2 and r
                                 or r.get("phase") == "Promoted" and r, "the next step", timeout=LOAD_TIMEOUT,
                                 interval=1, ignore=(KubectlError,))
            if resumed.get("step") == 2:
                assert resumed["stepStartedAt"] >= during["stepStartedAt"]
            assert deployment_uid(target, namespace, canary) == uid
            assert len(events(target, namespace, "RolloutStarted")) == 1
        promoted = phase(target, namespace, "Promoted")
        assert promoted["stable"] == canary and "promoted" in promoted["message"]
        assert promoted["analysis"]["greedyAgreement"] >= 0.8 * (promoted["analysis"].get("noiseFloor") or 1.0)
        eventually(lambda: engine_deployments(target, namespace) == {canary}, "the old revision gone",
                   timeout=120, ignore=(KubectlError,))
        eventually(lambda: drained(url, first), "the old revision drained", timeout=120)
        before = answered(url)
        after = eventually(lambda: (a := answered(url)).get(canary, 0) - before.get(canary, 0) >= 10 and a,
                           "10 requests after promotion", timeout=300)
        assert after.get(first, 0) == before.get(first, 0)  # int8 serves 100%

        # A variant that cannot pass the gate: rolled back automatically, with the figure.
        strict = {**ANALYSIS, "failureLimit": 1,
                  "quality": {**ANALYSIS["quality"], "minGreedyAgreement": 0.995}}
        apply(target, namespace, "int4-rtn", strict)
        rolled = phase(target, namespace, "RolledBack")
        bad = rolled["rolledBack"]
        assert rolled["stable"] == canary and bad != canary
        assert rolled["analysis"]["greedyAgreement"] < 0.995 * (rolled["analysis"].get("noiseFloor") or 1.0)
        assert "greedy agreement" in rolled["message"]
        warning = eventually(lambda: [e for e in events(target, namespace, "RolledBack") if e["type"] == "Warning"],
                             "the RolledBack Warning event", timeout=60, ignore=(KubectlError,))
        assert "greedy agreement" in warning[0]["message"] and bad in warning[0]["message"]
        eventually(lambda: engine_deployments(target, namespace) == {canary}, "the canary removed",
                   timeout=120, ignore=(KubectlError,))
        assert revisions(target, namespace)[canary]["weight"] == 100
        eventually(lambda: drained(url, bad), "the canary drained", timeout=120)
        before = answered(url)
        after = eventually(lambda: (a := answered(url)).get(canary, 0) - before.get(canary, 0) >= 10 and a,
                           "10 requests after the rollback", timeout=300)
        assert after.get(bad, 0) == before.get(bad, 0)  # stable serves 100% again
        # The spec still asks for the rolled-back revision: it is not retried.
        assert rollout(target, namespace)["phase"] == "RolledBack"
    assert load.done > 0 and not load.failures, f"{len(load.failures)} requests failed: {load.failures[:3]}"
