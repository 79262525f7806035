"""The InferenceService CRD: generated from the models, kept in sync, and enforced by a real
API server (the CEL rules and their messages)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from kiln.operator import crds
from kiln.operator.models import InferenceServiceSpec

ROOT = Path(__file__).resolve().parents[1]


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from schema_nodes(node[key], f"{path}[]")


def test_crds_folder_matches_the_models():
    stale = crds.stale_files(ROOT / "crds")
    assert not stale, f"crds/ is stale ({stale}): run `kiln crds` and commit the result"


def test_crds_check_flag_detects_a_stale_file(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    crds.add_arguments(parser)
    assert crds.run(parser.parse_args(["--out-dir", str(tmp_path)])) == 0
    assert crds.run(parser.parse_args(["--out-dir", str(tmp_path), "--check"])) == 0
    (tmp_path / crds.CRD_FILE).write_text((tmp_path / crds.CRD_FILE).read_text().replace("isvc", "isv"))
    assert crds.run(parser.parse_args(["--out-dir", str(tmp_path), "--check"])) == 1


def test_crds_default_to_the_checkouts_folder_else_the_working_directorys(tmp_path):
    """From a source checkout, crds/ beside pyproject.toml; installed from a wheel, ./crds (not a
    folder beside site-packages)."""
    assert crds.REPO_CRDS == ROOT / "crds"
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "operator" / "kiln" / "operator", site / "kiln" / "operator")
    where = subprocess.run([sys.executable, "-c", "from kiln.operator import crds; print(crds.REPO_CRDS)"],
                           env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert where.stdout.strip() == "crds", where.stderr


def test_crds_out_dir_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
    parser = __import__("argparse").ArgumentParser()
    crds.add_arguments(parser)
    a_file = tmp_path / "file"
    a_file.write_text("")
    for out in (a_file, a_file / "under"):
        assert crds.run(parser.parse_args(["--out-dir", str(out)])) == 2
        assert capsys.readouterr().err.startswith("kiln crds: ")
    (tmp_path / "dir" / crds.CRD_FILE).mkdir(parents=True)  # --check meets a folder where the file goes
    assert crds.run(parser.parse_args(["--out-dir", str(tmp_path / "dir"), "--check"])) == 2
    capsys.readouterr()
    assert crds.run(parser.parse_args(["--out-dir", str(tmp_path / "missing"), "--check"])) == 2
    assert "no such directory" in capsys.readouterr().err and not (tmp_path / "missing").exists()


def test_schema_is_structural():
    version = crds.build_crd()["spec"]["versions"][0]
    for path, node in schema_nodes(version["schema"]["openAPIV3Schema"]):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "nullable"} & node.keys(), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if isinstance(node.get("default"), dict) and node["default"]:
            pytest.fail(f"{path}: object defaults should be {{}} so nested defaults apply")
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"] and "self" in rule["rule"], path
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c] == \
        ["Ready", "Reason", "Replicas", "Model", "Age"]


# ----- against the real API server -----------------------------------------------------------

GOOD = {"model": {"name": "smollm2-135m", "source": "builtin://smollm2-135m"}}


def with_spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = spec
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return spec


# (case id, metadata.name, spec, words the API server's message must contain)
INVALID = [
    ("min-above-max", "bad", with_spec(autoscaling__minReplicas=5, autoscaling__maxReplicas=2),
     "autoscaling.minReplicas must not be greater than autoscaling.maxReplicas"),
    ("weights-not-increasing", "bad", with_spec(rollout__steps=[{"weight": 50}, {"weight": 10}]),
     "rollout.steps weights must be strictly increasing"),
    ("weights-repeated", "bad", with_spec(rollout__steps=[{"weight": 20}, {"weight": 20}]),
     "rollout.steps weights must be strictly increasing"),
    ("weight-above-100", "bad", with_spec(rollout__steps=[{"weight": 150}]),
     "should be less than or equal to 100"),
    ("tp-does-not-divide-gpus", "bad", with_spec(engine__tensorParallelSize=2, resources__gpus=3),
     "resources.gpus must equal engine.tensorParallelSize"),
    ("gpus-past-the-ranks", "bad", with_spec(engine__tensorParallelSize=2, resources__gpus=4),
     "resources.gpus must equal engine.tensorParallelSize (one GPU per rank; more would sit idle)"),
    ("gpus-without-tp", "bad", with_spec(resources__gpus=2), "resources.gpus must equal engine.tensorParallelSize"),
    ("tp-without-gpus", "bad", with_spec(engine__tensorParallelSize=2, resources__gpus=0),
     "engine.tensorParallelSize is larger than resources.gpus"),
    ("bad-duration", "bad", with_spec(autoscaling__stableWindow="1 minute"),
     "must be a duration such as 30s, 5m or 1h"),
    ("bad-progress-deadline", "bad", with_spec(rollout={"steps": [{"weight": 10}], "progressDeadline": "10 min"}),
     "must be a duration such as 30s, 5m or 1h"),
    ("zero-min-requests", "bad", with_spec(rollout={"steps": [{"weight": 10}], "analysis": {"minRequests": 0}}),
     "should be greater than or equal to 1"),
    ("bad-quantity", "bad", with_spec(resources__memory="16GB"),
     "must be a Kubernetes quantity such as 4, 500m, 512Mi or 16Gi"),
    ("negative-quantity", "bad", with_spec(resources__cpu=-2),
     "must be a Kubernetes quantity such as 4, 500m, 512Mi or 16Gi"),
    ("toleration-without-key", "bad", with_spec(resources__tolerations=[{"operator": "Equal", "value": "x"}]),
     "a toleration without key must have operator Exists"),
    ("toleration-seconds-without-no-execute", "bad",
     with_spec(resources__tolerations=[{"key": "k", "operator": "Exists", "tolerationSeconds": 30}]),
     "a toleration with tolerationSeconds must have effect NoExecute"),
    ("hpa-scale-down-over-an-hour", "bad", with_spec(autoscaling={"mode": "hpa", "scaleDownDelay": "2h"}),
     "autoscaling.scaleDownDelay must be at most 1h with mode hpa or keda"),
    ("keda-scale-down-over-an-hour", "bad", with_spec(autoscaling={"mode": "keda", "scaleDownDelay": "61m"}),
     "autoscaling.scaleDownDelay must be at most 1h with mode hpa or keda"),
    ("stable-window-zero", "bad", with_spec(autoscaling={"stableWindow": "0s", "panicWindow": "0s"}),
     "autoscaling.stableWindow must be at least 6s"),
    ("panic-window-longer", "bad", with_spec(autoscaling={"stableWindow": "10s", "panicWindow": "30s"}),
     "autoscaling.panicWindow must be at least 1s and not longer than autoscaling.stableWindow"),
    ("panic-window-sub-second", "bad", with_spec(autoscaling={"panicWindow": "500ms"}),
     "autoscaling.panicWindow must be at least 1s"),
    ("activation-timeout-sub-second", "bad", with_spec(autoscaling={"activationTimeout": "500ms"}),
     "autoscaling.activationTimeout must be at least 1s"),  # the router refused to start on it
    ("bad-source-scheme", "bad", with_spec(model__source="s3://bucket/model"),
     "must be builtin://<name>, pvc://<claim>/<path> or hostpath:///<absolute path>"),
    ("host-root-as-source", "bad", with_spec(model__source="hostpath:////"),  # would mount the node's / over the pod's
     "must be builtin://<name>, pvc://<claim>/<path> or hostpath:///<absolute path>"),
    ("parent-in-host-path", "bad", with_spec(model__source="hostpath:///models/../etc"),  # refused in a pod
     "without a .. segment"),
    ("parent-in-adapter-claim", "bad", with_spec(engine__adapters=[{"name": "a", "source": "pvc://loras/../x"}]),
     "without a .. segment"),
    ("progress-deadline-zero", "bad", with_spec(rollout={"steps": [{"weight": 10}], "progressDeadline": "0s"}),
     "rollout.progressDeadline must be at least 1s"),
    ("analysis-interval-zero", "bad", with_spec(rollout={"steps": [{"weight": 10}], "analysis": {"interval": "0s"}}),
     "rollout.analysis.interval must be at least 1s"),
    ("api-key-secret-bad-name", "bad", with_spec(auth={"apiKeySecretRef": {"name": "Chat_Keys"}}),
     "spec.auth.apiKeySecretRef.name in body should match"),
    ("api-key-secret-bad-key", "bad", with_spec(auth={"apiKeySecretRef": {"name": "keys", "key": "api keys"}}),
     "spec.auth.apiKeySecretRef.key in body should match"),
    ("toleration-bad-key", "bad", with_spec(resources__tolerations=[{"key": "gpu type!", "operator": "Exists"}]),
     "spec.resources.tolerations[0].key in body should match"),
    ("toleration-key-name-too-long", "bad", with_spec(resources__tolerations=[{"key": "a" * 64, "operator": "Exists"}]),
     "spec.resources.tolerations[0].key in body should match"),  # every Deployment was refused instead
    ("toleration-key-prefix-too-long", "bad", with_spec(resources__tolerations=[
        {"key": "a" * 254 + "/b", "operator": "Exists"}]), "prefix (before the /) is at most 253 characters"),
    ("quantity-exponent-too-long", "bad", with_spec(engine__kvCache={"memory": "1e999999"}),
     "must be a Kubernetes quantity such as 4, 500m, 512Mi or 16Gi"),
    ("node-selector-bad-value", "bad", with_spec(resources__nodeSelector={"pool": "a b"}),
     "spec.resources.nodeSelector.pool in body should match"),
    ("ratio-below-one", "bad", with_spec(rollout__steps=[{"weight": 10}],
                                         rollout__analysis={"maxTimeToFirstTokenP95Ratio": 0.8}),
     "maxTimeToFirstTokenP95Ratio in body should be greater than or equal to 1"),
    ("unknown-quantization", "bad", with_spec(engine__quantization="int3"),
     'supported values: "none", "int8", "int4", "int4-rtn", "fp8"'),
    ("unknown-kv-cache-dtype", "bad", with_spec(engine__kvCache={"dtype": "int4"}),
     'supported values: "auto", "int8", "fp8"'),
    ("draft-without-model", "bad", with_spec(engine__speculative={"method": "draft"}),
     "speculative.method draft needs speculative.model"),
    ("adapter-builtin", "bad", with_spec(engine__adapters=[{"name": "a", "source": "builtin://smollm2-135m"}]),
     "must be pvc://<claim>/<path> or hostpath:///<absolute path>"),
    ("adapter-named-as-model", "bad", with_spec(model__name="chat", engine__adapters=[
        {"name": "chat", "source": "pvc://loras/a"}]), "requests could not tell them apart"),
    # No model.name: the served name is the source's last part (ModelSpec.served_name), in CEL too.
    ("adapter-named-as-source-folder", "bad", {"model": {"source": "pvc://models/llama//"}, "engine": {
        "adapters": [{"name": "llama", "source": "pvc://loras/a"}]}}, "requests could not tell them apart"),
    ("adapter-named-as-gguf", "bad", {"model": {"source": "hostpath:///m/chat.gguf"}, "engine": {
        "adapters": [{"name": "chat", "source": "pvc://loras/a"}]}}, "requests could not tell them apart"),
    ("adapter-named-as-builtin", "bad", {"model": {"name": "", "source": "builtin://smollm2-135m"}, "engine": {
        "adapters": [{"name": "smollm2-135m", "source": "pvc://loras/a"}]}}, "requests could not tell them apart"),
    ("adapter-twice", "bad", with_spec(engine__adapters=[{"name": "a", "source": "pvc://x"},
                                                         {"name": "a", "source": "pvc://y"}]), "Duplicate value"),
    ("pull-secret-twice", "bad", with_spec(imagePullSecrets=[{"name": "regcred"}, {"name": "regcred"}]),
     "Duplicate value"),
    ("pull-secret-bad-name", "bad", with_spec(imagePullSecrets=[{"name": "Reg_Cred"}]),
     "spec.imagePullSecrets[0].name in body should match"),
    ("env-twice", "bad", with_spec(engine__env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
     "Duplicate value"),
    ("env-value-and-value-from", "bad", with_spec(engine__env=[
        {"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
     "an env entry takes value or valueFrom, not both"),
    ("env-two-sources", "bad", with_spec(engine__env=[{"name": "A", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}}]),
     "valueFrom takes exactly one of secretKeyRef and configMapKeyRef"),
    ("env-bad-name", "bad", with_spec(engine__env=[{"name": "A=B", "value": "1"}]),
     "spec.engine.env[0].name in body should match"),
    ("env-name-dots", "bad", with_spec(engine__env=[{"name": "..x", "value": "1"}]),
     "must not be '.' or start with '..'"),
    ("missing-source", "bad", {"model": {"name": "x"}}, "spec.model.source: Required value"),
    ("name-too-long", "a" * 51, GOOD, "metadata.name must be at most 50 lowercase letters"),
]


@pytest.mark.parametrize("case, name, spec, message", INVALID, ids=[c[0] for c in INVALID])
def test_api_server_rejects_invalid_spec_with_a_clear_message(custom_api, kiln_installed, namespace,
                                                              case, name, spec, message):
    from kubernetes.client.rest import ApiException
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": spec}
    with pytest.raises(ApiException) as err:
        custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", namespace, "inferenceservices", body)
    assert err.value.status == 422, err.value.body
    assert message in json.loads(err.value.body)["message"]


def test_api_server_fills_defaults_and_keeps_the_full_example(custom_api, kiln_installed, namespace):
    full = yaml.safe_load((ROOT / "examples/full.yaml").read_text())
    minimal = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "minimal"}, "spec": GOOD}
    stored = custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", namespace,
                                                        "inferenceservices", minimal, dry_run="All")
    assert stored["spec"]["engine"]["kvCache"] == {"prefixCaching": True, "dtype": "auto"}
    assert stored["spec"]["resources"]["gpus"] == 0 and stored["spec"]["replicas"] == 1
    full["metadata"] = {"name": "chat"}
    stored = custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", namespace,
                                                        "inferenceservices", full, dry_run="All")
    assert stored["spec"] == full["spec"] | {"replicas": 1}  # nothing pruned, only defaults added
    # A claim's name is a DNS subdomain: dots allowed.
    dotted = {**minimal, "spec": {**GOOD, "model": {"source": "pvc://weights.v2/llama/model.gguf"}}}
    stored = custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", namespace,
                                                        "inferenceservices", dotted, dry_run="All")
    assert stored["spec"]["model"]["source"] == "pvc://weights.v2/llama/model.gguf"
    # Adapters and a draft model with tensor parallelism: the engine serves both.
    both = with_spec(engine__tensorParallelSize=2, resources__gpus=2,
                     engine__adapters=[{"name": "a", "source": "pvc://loras/a"}],
                     engine__speculative={"method": "draft", "model": {"source": "pvc://drafts/d"}})
    stored = custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", namespace, "inferenceservices",
                                                        {**minimal, "spec": both}, dry_run="All")
    assert stored["spec"]["engine"]["adapters"] == both["engine"]["adapters"]
    # An adapter named near the served name, not as it: taken (the API server and the operator agree).
    near = {"model": {"source": "hostpath:///m/chat.gguf"}, "engine": {"adapters": [
        {"name": "chat.gguf", "source": "pvc://loras/a"}, {"name": "m", "source": "pvc://loras/b"}]}}
    InferenceServiceSpec.model_validate(near)
    custom_api.create_namespaced_custom_object("kiln.dev", "v1alpha1", namespace, "inferenceservices",
                                               {**minimal, "spec": near}, dry_run="All")
