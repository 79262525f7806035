"""`kiln operator`'s rollouts against the real local control plane, with kwok for kubelets: the
canary's Deployment beside the stable one, weights in status, a canary that cannot become
ready (it asks for more GPUs than a node has) rolled back after its progress deadline, a spec
changed mid-rollout, the retry annotation, and a spec changed back. (Analysis on real engines
and routers: e2e/test_canary.py; the step machine itself: test_rollout.py.)"""
from __future__ import annotations

from operator_support import absent, apply, condition, engine_deployments, events, isvc, ready, smollm2, until

NAME = "rolling"


def spec(quantization: str, gpus: int, deadline: str) -> dict:
    body = smollm2(NAME, gpus=gpus)
    body["spec"]["engine"]["quantization"] = quantization
    body["spec"]["rollout"] = {"steps": [{"weight": 25, "pause": "1m"}], "progressDeadline": deadline}
    return body


def rollout(apis, ns: str) -> dict:
    return (isvc(apis, ns, NAME).get("status") or {}).get("rollout") or {}


def deployments(apis, ns: str) -> dict[str, object]:
    return {d.metadata.name: d for d in engine_deployments(apis, ns, NAME) if not d.metadata.deletion_timestamp}


def reasons(apis, ns: str, reason: str) -> list:
    return [e for e in events(apis, ns, NAME) if e.reason == reason]


def test_canaries_start_beside_stable_and_go_on_deadline_change_or_revert(operator, apis, ns, kubectl):
    apply(kubectl, ns, spec("none", 0, "1h"))
    obj = until(lambda: ready(apis, ns, NAME), "Ready")
    (stable,) = deployments(apis, ns)
    stable_uid = deployments(apis, ns)[stable].metadata.uid
    assert obj["status"]["rollout"]["phase"] == "Promoted" and obj["status"]["rollout"]["stable"] == stable
    assert [(r["role"], r["weight"]) for r in obj["status"]["revisions"]] == [("stable", 100)]

    # A canary that cannot be scheduled (8 GPUs; kwok nodes have 4) starts beside stable.
    apply(kubectl, ns, spec("int8", 8, "1h"))
    first = until(lambda: rollout(apis, ns).get("canary"), "a canary")
    assert set(deployments(apis, ns)) == {stable, first}
    assert deployments(apis, ns)[first].spec.replicas == 1
    weights = {r["name"]: (r["role"], r["weight"], r["quantization"]) for r in isvc(apis, ns, NAME)["status"]["revisions"]}
    assert weights == {stable: ("stable", 100, "none"), first: ("canary", 0, "int8")}  # not ready: no share
    assert condition(isvc(apis, ns, NAME), "CanaryReady")["reason"] == "Progressing"
    # The stable revision is left as it was: the spec's new resources are the canary's.
    assert deployments(apis, ns)[stable].metadata.uid == stable_uid
    assert "nvidia.com/gpu" not in (deployments(apis, ns)[stable].spec.template.spec.containers[0].resources.limits or {})

    # Changed again mid-rollout: the newest revision becomes the canary, the half-rolled one goes.
    apply(kubectl, ns, spec("int4-rtn", 8, "1h"))
    second = until(lambda: (c := rollout(apis, ns).get("canary")) != first and c, "the newest canary")
    until(lambda: set(deployments(apis, ns)) == {stable, second}, "the first canary deleted")
    until(lambda: len(reasons(apis, ns, "RolloutStarted")) == 2, "the second RolloutStarted")  # posted after the status

    # Its progress deadline passes: rolled back, said in a Warning, Deployment removed.
    apply(kubectl, ns, spec("int4-rtn", 8, "3s"))
    done = until(lambda: (r := rollout(apis, ns)).get("phase") == "RolledBack" and r, "rolled back")
    assert done["rolledBack"] == second and "progressDeadline" in done["message"]
    until(lambda: set(deployments(apis, ns)) == {stable}, "the canary deleted")
    warning = until(lambda: [e for e in reasons(apis, ns, "RolledBack") if e.type == "Warning"], "a Warning Event")
    assert second in warning[0].message
    assert [(r["role"], r["weight"]) for r in isvc(apis, ns, NAME)["status"]["revisions"]] == [("stable", 100)]
    assert until(lambda: ready(apis, ns, NAME), "still Ready")  # stable serves all along

    # The spec still asks for it: not retried, until the annotation says so.
    started = len(reasons(apis, ns, "RolloutStarted"))
    kubectl("annotate", "isvc", NAME, "-n", ns, "kiln.dev/retry-rollout=1")
    until(lambda: len(reasons(apis, ns, "RolloutStarted")) == started + 1, "the retry")
    until(lambda: rollout(apis, ns).get("phase") == "RolledBack" and len(deployments(apis, ns)) == 1,
          "rolled back again")
    assert rollout(apis, ns)["retryToken"] == "1"

    # Back to the stable revision's spec while a canary runs: the canary is dropped, not failed.
    apply(kubectl, ns, spec("int8", 8, "1h"))
    until(lambda: rollout(apis, ns).get("phase") == "Progressing", "another rollout")
    apply(kubectl, ns, spec("none", 0, "1h"))
    until(lambda: condition(isvc(apis, ns, NAME), "CanaryReady").get("reason") == "Aborted", "aborted")
    until(lambda: set(deployments(apis, ns)) == {stable}, "only the stable revision")
    assert deployments(apis, ns)[stable].metadata.uid == stable_uid
    apis["custom"].delete_namespaced_custom_object("kiln.dev", "v1alpha1", ns, "inferenceservices", NAME)
    until(lambda: absent(lambda: isvc(apis, ns, NAME)), "deleted")
