"""An engine that cannot start says why in the InferenceService's status. A chat template that does
not compile makes the engine exit at start (code 2, one error line); the pod's termination message
(FallbackToLogsOnError: its log's end) reaches ModelLoaded and Ready as EngineFailing, with one
Warning Event each however often the container restarts; fixing the spec makes it Ready. The same
mistake as a canary is rolled back after 3 failed starts, not after the progress deadline."""
from __future__ import annotations

import json

import pytest
import yaml

from e2e_support import LOAD_TIMEOUT, REPO, Target
from kiln.local.testing import KubectlError, eventually

NAME = "smollm2-broken"

pytestmark = pytest.mark.timeout(1800)


def conditions(target: Target, namespace: str) -> dict[str, dict]:
    status = json.loads(target.kubectl("get", "isvc", NAME, "-n", namespace, "-o", "json")).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def rollout_of(target: Target, namespace: str) -> dict:
    status = json.loads(target.kubectl("get", "isvc", NAME, "-n", namespace, "-o", "json")).get("status") or {}
    return status.get("rollout") or {}


def warnings(target: Target, namespace: str) -> list[tuple[str, str]]:
    """(reason, message) of the InferenceService's Warning Events."""
    found = json.loads(target.kubectl("get", "events", "-n", namespace, "-o", "json", "--field-selector",
                                      f"involvedObject.name={NAME},type=Warning"))
    return [(e["reason"], e["message"]) for e in found["items"]]


def test_an_engine_that_cannot_start_says_why_in_the_status(target: Target, namespace: str, operator: None) -> None:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = NAME
    body["spec"]["engine"]["chatTemplate"] = "{% for m in messages %}{{ m.content }}"  # no endfor
    target.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    try:
        failing = eventually(lambda: (c := conditions(target, namespace).get("ModelLoaded")) and
                             c["reason"] == "EngineFailing" and c, "ModelLoaded=False EngineFailing",
                             timeout=300, ignore=(KubectlError,))
        assert failing["status"] == "False" and "the engine exited with code 2 (Error)" in failing["message"]
        assert "--chat-template: the template does not compile" in failing["message"], failing
        assert conditions(target, namespace)["Ready"]["message"] == failing["message"]
        # Restarted at least once more (the runtime's back-off is 5 s): still one Warning for it.
        pod = json.loads(target.kubectl("get", "pods", "-n", namespace, "-o", "json", "-l",
                                        f"kiln.dev/inferenceservice={NAME},kiln.dev/component=engine"))["items"][0]
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        eventually(lambda: json.loads(target.kubectl("get", "pod", pod["metadata"]["name"], "-n", namespace, "-o",
                                                     "json"))["status"]["containerStatuses"][0]["restartCount"]
                   > restarts, "another restart", timeout=120)
        told = [message.split(":")[0] for reason, message in warnings(target, namespace) if reason == "EngineFailing"]
        assert sorted(told) == ["ModelLoaded=False", "Ready=False"]  # one Event each
        target.kubectl("patch", "isvc", NAME, "-n", namespace, "--type=json",
                       "-p", '[{"op": "remove", "path": "/spec/engine/chatTemplate"}]')
        target.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"--timeout={LOAD_TIMEOUT}s",
                       f"inferenceservice/{NAME}", timeout=LOAD_TIMEOUT + 30)

        # The same mistake as a canary: rolled back once its engine failed to start 3 times, long
        # before the 10 minute progressDeadline; the stable revision serves throughout.
        body["spec"]["rollout"] = {"steps": [{"weight": 50, "pause": "10s"}], "progressDeadline": "10m"}
        target.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
        rollout = eventually(lambda: (r := rollout_of(target, namespace)) and r.get("phase") == "RolledBack" and r,
                             "the canary rolled back", timeout=300, ignore=(KubectlError,))
        assert "its engine failed to start 3 times" in rollout["message"], rollout
        assert "the template does not compile" in rollout["message"], rollout
        assert conditions(target, namespace)["Ready"]["status"] == "True"
    finally:
        target.kubectl("delete", "isvc", NAME, "-n", namespace, "--wait=false", check=False)
