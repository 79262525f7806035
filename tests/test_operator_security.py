"""What the operator makes, against the real API server's own checks: every pod (engine, router,
the operator's) is admitted under the `restricted` Pod Security Standard by the PodSecurity
admission plugin; engine pods take connections only from their router and the operator (the
stored NetworkPolicy selects exactly those pods); `spec.auth` hands the router its keys from a
Secret. (The local cluster has no network plugin enforcing policies: the policy is checked as
stored and against the pods it selects.)"""
from __future__ import annotations

import base64
from pathlib import Path

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from kiln.local.cluster import free_port
from operator_support import a_pass_ran, apply, engines, passes, smollm2, until

REPO = Path(__file__).resolve().parents[1]
NAME = "guarded"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}


def names(apis, ns: str, selector: dict[str, str]) -> set[str]:
    found = apis["core"].list_namespaced_pod(ns, label_selector=",".join(f"{k}={v}" for k, v in selector.items()))
    return {p.metadata.name for p in found.items if not p.metadata.deletion_timestamp}


def test_pods_are_admitted_as_restricted_and_engines_take_only_router_and_operator(operator, apis, ns, kubectl):
    port = free_port()
    operator.restart(f"--metrics-port={port}")  # its passes counted; only watch events wake them
    apis["core"].patch_namespace(ns, {"metadata": {"labels": RESTRICTED}})
    apis["core"].create_namespaced_secret(ns, {"metadata": {"name": "keys"}, "type": "Opaque",
                                               "data": {"api-keys": base64.b64encode(b"k1\nk2\n").decode()}})
    body = smollm2(NAME)
    body["spec"]["auth"] = {"apiKeySecretRef": {"name": "keys"}}
    apply(kubectl, ns, body)
    router_selector = {"kiln.dev/inferenceservice": NAME, "kiln.dev/component": "router"}
    # The ReplicaSets could create them: PodSecurity admission let them in (else FailedCreate).
    engine_pods = until(lambda: names(apis, ns, {"kiln.dev/inferenceservice": NAME, "kiln.dev/component": "engine"}),
                        "an engine pod admitted")
    router_pods = until(lambda: names(apis, ns, router_selector), "a router pod admitted")
    assert engines(NAME)

    policy = until(lambda: kubernetes.client.NetworkingV1Api(apis["core"].api_client).read_namespaced_network_policy(
        f"{NAME}-engines", ns), "the engines' NetworkPolicy")
    assert names(apis, ns, policy.spec.pod_selector.match_labels) == engine_pods
    assert policy.spec.policy_types == ["Ingress", "Egress"] and len(policy.spec.ingress) == 1
    assert not policy.spec.egress  # engines open no connection
    sources = policy.spec.ingress[0]._from
    assert names(apis, ns, sources[0].pod_selector.match_labels) == router_pods
    assert sources[1].namespace_selector.match_labels == {"kubernetes.io/metadata.name": "kiln-system"}
    assert [p.port for p in policy.spec.ingress[0].ports] == ["http"]

    # Stored as rendered: the operator does not patch it again and again (an empty egress list,
    # which the API server drops, once made it do that).
    networking = kubernetes.client.NetworkingV1Api(apis["core"].api_client)
    version = networking.read_namespaced_network_policy(f"{NAME}-engines", ns).metadata.resource_version
    base = passes(port, ns, NAME)

    def poke(value: str) -> None:  # a change to the InferenceService wakes a pass that reads it all afresh
        apis["custom"].patch_namespaced_custom_object("kiln.dev", "v1alpha1", ns, "inferenceservices", NAME,
                                                      {"metadata": {"annotations": {"test/poke": value}}})
    poke("1")
    until(lambda: passes(port, ns, NAME) > base, "a pass after the poke")
    poke("2")  # the next pass begins once that one has ended
    a_pass_ran(port, ns, NAME, since=base)
    assert networking.read_namespaced_network_policy(f"{NAME}-engines", ns).metadata.resource_version == version

    router = apis["apps"].read_namespaced_deployment(f"{NAME}-router", ns)
    env = {e.name: e for e in router.spec.template.spec.containers[0].env}
    ref = env["KILN_API_KEYS"].value_from.secret_key_ref
    assert (ref.name, ref.key) == ("keys", "api-keys")


def test_the_operator_pod_itself_is_admitted_as_restricted(apis, ns):
    """Its Deployment's pod template, created as a Pod (server-side dry run: admission runs, nothing is stored)."""
    docs = yaml.safe_load_all((REPO / "manifests/base/operator.yaml").read_text())
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    apis["core"].patch_namespace(ns, {"metadata": {"labels": RESTRICTED}})
    spec = {k: v for k, v in deployment["spec"]["template"]["spec"].items() if k != "serviceAccountName"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator-dry-run"}, "spec": spec}  # no SA here
    apis["core"].create_namespaced_pod(ns, pod, dry_run="All")
    # And the check is real: a pod that may escalate privileges is refused.
    bad = {**pod, "spec": {**pod["spec"], "containers": [{**pod["spec"]["containers"][0], "securityContext": {}}]}}
    with pytest.raises(ApiException) as refused:
        apis["core"].create_namespaced_pod(ns, bad, dry_run="All")
    assert refused.value.status == 403 and "restricted" in refused.value.body


def test_auth_without_a_secret_name_is_refused(custom_api, ns):
    body = smollm2("no-secret")
    body["spec"]["auth"] = {"apiKeySecretRef": {"key": "api-keys"}}
    with pytest.raises(ApiException) as refused:
        custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", ns, "inferenceservices", body)
    assert refused.value.status == 422 and "name" in refused.value.body
