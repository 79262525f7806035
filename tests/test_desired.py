"""Pure parts of the operator: desired children and status from a spec and what was observed,
no cluster needed. (plan() on recorded cluster states: tests/test_plan.py.)"""
from __future__ import annotations

import argparse
import copy
import re
import socket
from pathlib import Path, PurePosixPath
from unittest.mock import ANY

import pytest
import yaml

from kiln.engine.speculative import SpeculativeConfig
from kiln.operator.desired import Desired, desired, desired_replicas, handover
from kiln.operator.models import Engine, InferenceServiceSpec, ModelSpec
from kiln.operator.observed import Observed
from kiln.operator.plan import plan
from kiln.operator.render import ANNOTATION_QUANTIZATION, LABEL_REVISION, Owner, revision_name
from kiln.operator.status import summarize, transitions
from kiln.router import main as router_main

ROOT = Path(__file__).resolve().parents[1]
FULL_EXAMPLE = ROOT / "examples/full.yaml"
OWNER = Owner("chat", "ml", "uid-1")
IMAGE = "registry.example/kiln/engine:test"


def spec_of(**overrides) -> InferenceServiceSpec:
    raw = {"model": {"source": "builtin://smollm2-135m"}}
    raw.update(overrides)
    return InferenceServiceSpec.model_validate(raw)


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def want(spec: InferenceServiceSpec, observed: Observed = Observed(), annotations: dict | None = None) -> Desired:
    return desired(OWNER, spec, observed, IMAGE, annotations)


def child(wanted: Desired, kind: str, name: str) -> dict:
    return next(o for o in wanted.objects() if (o["kind"], o["metadata"]["name"]) == (kind, name))


def test_user_examples_parse():
    spec = InferenceServiceSpec.model_validate(yaml.safe_load((ROOT / "examples/smollm2.yaml").read_text())["spec"])
    assert spec.model.name == "smollm2-135m" and spec.resources.gpus == 1
    full = InferenceServiceSpec.model_validate(yaml.safe_load(FULL_EXAMPLE.read_text())["spec"])
    assert full.rollout.steps[1].weight == 50


def test_unknown_field_is_an_error():
    with pytest.raises(ValueError, match="quantisation"):
        spec_of(engine={"quantisation": "int4"})


def test_a_stored_spec_with_fields_this_operator_does_not_know_is_read_without_them():
    """A CRD newer than the operator defaults fields into every stored object: refused, every
    service was InvalidSpec and nothing reconciled until the operator caught up."""
    from kiln.operator.stored import parse_spec
    newer = {"model": {"source": "builtin://smollm2-135m"}, "engine": {"maxNumSeqs": 8, "newKnob": "auto"},
             "autoscaling": {"mode": "builtin", "coldStartBudget": "30s"}, "futureBlock": {"a": 1}}
    spec, unknown = parse_spec({"spec": newer})
    assert (spec.engine.maxNumSeqs, spec.autoscaling.mode) == (8, "builtin")
    assert sorted(unknown) == ["autoscaling.coldStartBudget", "engine.newKnob", "futureBlock"]
    assert "newKnob" in newer["engine"]  # the stored body is not changed
    assert parse_spec({"spec": {"model": {"source": "builtin://smollm2-135m"}}})[1] == []
    # Anything else wrong is still refused, unknown fields or not.
    for bad in ({**newer, "replicas": -1}, {"model": {"source": "s3://x"}, "newKnob": 1}):
        with pytest.raises(ValueError, match="spec does not match this operator's models"):
            parse_spec({"spec": bad})


def test_quantities_are_checked_by_the_operator_too():
    # A spec stored under an older CRD reaches the operator unchecked: a negative count or a
    # non-quantity is an invalid spec naming the field, never a pod the API server refuses or
    # a crash converting the KV cache's size.
    for block, value in (("resources", {"cpu": -2}), ("resources", {"memory": "16GB"}),
                         ("engine", {"kvCache": {"memory": "4GB"}})):
        with pytest.raises(ValueError, match="must be a Kubernetes quantity"):
            spec_of(**{block: value})
    for memory in (0, "0", "500m", "1e-3"):  # quantities, but no whole byte of KV cache
        with pytest.raises(ValueError, match="must be at least one byte"):
            spec_of(engine={"kvCache": {"memory": memory}})
    for huge in ("1e999999", "1" * 70):  # an integer of a million digits held every thread for 30 s
        with pytest.raises(ValueError, match="must be a Kubernetes quantity|at most 2\\^63-1"):
            spec_of(engine={"kvCache": {"memory": huge}})
    for huge in ("1e60", "8Ei", 2**63):  # past the API server's largest quantity: desired() raised on each pass
        with pytest.raises(ValueError, match=r"must be at most 2\^63-1"):
            spec_of(resources={"cpu": huge})
    assert spec_of(resources={"memory": "7Ei"}).resources.memory == "7Ei"
    assert spec_of(resources={"cpu": "500m", "memory": "1.5Gi"}).resources.memory == "1.5Gi"
    assert spec_of(resources={"cpu": 4, "memory": "2e3"}).resources.cpu == 4


def test_a_chat_template_past_one_command_line_argument_is_refused():
    """The engine takes it as one argument: over Linux's 128 KiB in UTF-8 the container could
    never start (E2BIG). Characters alone (the CRD's bound) do not tell: ASCII fits four times more."""
    assert spec_of(engine={"chatTemplate": "x" * 65536}).engine.chatTemplate
    with pytest.raises(ValueError, match="131072 bytes in UTF-8 as the engine's argument"):
        spec_of(engine={"chatTemplate": "模" * 43690 + "xx"})
    # Its backslashes go doubled (the engine decodes an inline template's escapes).
    assert spec_of(engine={"chatTemplate": "\\" * 65535}).engine.chatTemplate
    with pytest.raises(ValueError, match="131072 bytes in UTF-8 as the engine's argument"):
        spec_of(engine={"chatTemplate": "\\" * 65536})


def test_sources_durations_and_replica_bounds_are_checked_by_the_operator_too():
    # The same: a source that would have been a hostPath of the node's root, its /etc, or an
    # unknown scheme read as a host path; a duration the autoscaler could not parse.
    for source in ("hostpath:////", "hostpath://etc", "s3://bucket/llama", "pvc://", "models/llama",
                   "hostpath:///models/../etc"):
        with pytest.raises(ValueError, match="must be builtin://<name>, pvc://<claim>/<path> or hostpath"):
            spec_of(model={"source": source})
    with pytest.raises(ValueError, match="must be pvc://<claim>/<path> or hostpath"):
        spec_of(engine={"adapters": [{"name": "a", "source": "hostpath:////"}]})
    with pytest.raises(ValueError, match="must be a duration such as 30s"):
        spec_of(autoscaling={"stableWindow": "abc"})
    # The builtin autoscaler ran minReplicas 5 above maxReplicas 2 (an HPA runs 2).
    with pytest.raises(ValueError, match="minReplicas must not be greater than autoscaling.maxReplicas"):
        spec_of(autoscaling={"minReplicas": 5, "maxReplicas": 2})
    assert spec_of(model={"source": "hostpath:///models/a..b"}).model.source == "hostpath:///models/a..b"


def test_children_carry_owner_labels_and_matching_selectors():
    wanted = want(spec_of(replicas=2))
    for obj in wanted.objects():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceService", "name": "chat",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"]["kiln.dev/inferenceservice"] == "chat"  # how a pass finds it
    stable = wanted.stable
    dep, revision_svc = stable.deployment, stable.service
    svc, pdb = child(wanted, "Service", "chat"), child(wanted, "PodDisruptionBudget", "chat-engine")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for sel in (dep["spec"]["selector"]["matchLabels"], revision_svc["spec"]["selector"],
                pdb["spec"]["selector"]["matchLabels"]):
        assert sel.items() <= pod_labels.items()
    assert dep["metadata"]["name"] == stable.name == pod_labels[LABEL_REVISION] == revision_svc["metadata"]["name"]
    # The revision Service's labels reach its EndpointSlices: the router's per-revision view.
    assert revision_svc["metadata"]["labels"][LABEL_REVISION] == stable.name
    assert revision_svc["spec"]["clusterIP"] == "None"
    # Replicas have their own writer: never in the main apply, but planned for the revision.
    assert "replicas" not in dep["spec"] and stable.replicas == 2 and stable.role == "stable"
    assert pdb["spec"]["maxUnavailable"] == 1
    # `chat` and `chat-router` in one namespace: no child of one has the name of the other's.
    other = desired(Owner("chat-router", "ml", "uid-2"), spec_of(), Observed(), "engine:test")
    names = [{(o["kind"], o["metadata"]["name"]) for o in w.objects()} for w in (wanted, other)]
    assert not names[0] & names[1], names[0] & names[1]
    # An older operator's engine budget, named as the InferenceService, goes as the new one comes.
    old_pdb = {**pdb, "metadata": {**pdb["metadata"], "name": "chat"}}
    actions = [(a.verb, a.kind, a.name) for a in plan(wanted, Observed.of(old_pdb))]
    assert ("create", "PodDisruptionBudget", "chat-engine") in actions
    assert ("delete", "PodDisruptionBudget", "chat") in actions
    # Users reach the router, never an engine directly.
    router = child(wanted, "Deployment", "chat-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"].items() <= router_labels.items()
    assert not svc["spec"]["selector"].items() <= pod_labels.items()
    assert router["spec"]["selector"]["matchLabels"].items() <= router_labels.items()
    (router_port,) = pod_spec(router)["containers"][0]["ports"]
    assert svc["spec"]["ports"][0]["targetPort"] == router_port["name"]


def test_router_discovers_every_revision_with_least_privilege():
    wanted = want(spec_of())
    pod = pod_spec(child(wanted, "Deployment", "chat-router"))
    (c,) = pod["containers"]
    assert c["command"][:2] == ["kiln", "router"]
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = parser.parse_args(c["command"][2:])
    # It reads the EndpointSlices of every revision's Service, on the port name engines carry.
    revision_svc = wanted.stable.service
    labels = dict(pair.split("=") for pair in args.selector.split(","))
    assert labels.items() <= revision_svc["metadata"]["labels"].items() and "kiln.dev/revision" not in labels
    assert [p["name"] for p in revision_svc["spec"]["ports"]] == [args.port_name or router_main.DEFAULT_PORT_NAME]
    assert c["env"] == [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    account, binding = child(wanted, "ServiceAccount", "chat-router"), child(wanted, "RoleBinding", "chat-router")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    # A binding to the fixed ClusterRole manifests/ ships, in this namespace only.
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "kiln-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "ml"}]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and pod["securityContext"]["runAsNonRoot"]


def rbac_documents() -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "manifests/base/rbac.yaml").read_text()))


def granted_by(role: str) -> set[tuple[str, str, str]]:
    rules = next(d for d in rbac_documents() if d["kind"] == "ClusterRole" and d["metadata"]["name"] == role)["rules"]
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_operator_cluster_role_covers_every_child_kind():
    """Observing a child needs list, server-side apply needs create and patch."""
    granted = granted_by("kiln-operator")
    for obj in want(spec_of()).objects():
        group = obj["apiVersion"].rpartition("/")[0]
        kind = obj["kind"].lower()
        resource = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        assert {(group, resource, v) for v in ("list", "create", "patch")} <= granted, obj["kind"]
    # What wakes a reconcile is watched; revisions and their Services are deleted.
    assert {("apps", "deployments", "watch"), ("", "pods", "watch"), ("", "services", "watch"),
            ("apps", "deployments", "delete"), ("", "services", "delete")} <= granted
    # The router's RoleBinding names the fixed kiln-router role, which the operator may bind but
    # does not hold, and roles are never created on the fly.
    assert ("rbac.authorization.k8s.io", "clusterroles", "bind") in granted
    assert not {("rbac.authorization.k8s.io", r, "create") for r in ("roles", "clusterroles")} & granted
    assert not any(r == "endpointslices" for _, r, _ in granted)
    assert granted_by("kiln-router") == {(group, resource, verb) for verb in ("list", "watch") for group, resource in
                                         (("discovery.k8s.io", "endpointslices"), ("kiln.dev", "inferenceservices"))}


def test_pod_annotations_go_on_every_pod_template():
    plain = want(spec_of())
    assert "annotations" not in plain.stable.deployment["spec"]["template"]["metadata"]
    marked = want(spec_of(), annotations={"kiln.dev/readiness": "runtime"})
    for dep in (marked.stable.deployment, child(marked, "Deployment", "chat-router")):
        assert dep["spec"]["template"]["metadata"]["annotations"] == {"kiln.dev/readiness": "runtime"}
    # Not part of the revision: annotating pods starts no rollout.
    assert marked.stable.name == plain.stable.name


def test_engine_container_command_resources_probes_and_hardening():
    spec = spec_of(engine={"dtype": "float32", "maxModelLen": 2048, "quantization": "int4",
                           "kvCache": {"memory": "256Mi", "prefixCaching": False, "dtype": "int8"},
                           "speculative": {"method": "ngram", "numTokens": 3, "disableByBatchSize": 8},
                           "toolCallParser": "hermes"},
                   resources={"gpus": 1, "cpu": 4, "memory": "16Gi", "nodeSelector": {"pool": "gpu"},
                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                               "effect": "NoSchedule"}]})
    pod = pod_spec(want(spec).stable.deployment)
    (c,) = pod["containers"]
    assert c["image"] == IMAGE
    assert c["command"] == ["kiln", "serve", "--model", "smollm2-135m", "--served-model-name", "smollm2-135m",
                            "--port", "8000", "--dtype", "float32",
                            "--max-num-seqs", "128", "--drain-timeout", "100", "--device", "cuda",
                            "--kv-cache-memory", str(256 << 20),
                            "--max-model-len", "2048", "--no-prefix-caching",
                            "--quantization", "int4", "--kv-cache-dtype", "int8", "--speculative-config", ANY,
                            "--tool-call-parser", "hermes"]
    # In-flight generations may run for the pod's grace period, less the preStop pause and a margin
    # to stop (the engine's own default, 30 s, cut them with 80 s of the grace period left).
    assert pod["terminationGracePeriodSeconds"] - c["lifecycle"]["preStop"]["sleep"]["seconds"] - 100 == 10
    # The engine takes the operator's speculative config as written.
    speculative = SpeculativeConfig.from_json(c["command"][-3])
    assert (speculative.num_speculative_tokens, speculative.disable_by_batch_size) == (3, 8)
    from kiln.engine import server  # imports torch: only in the tests that parse its command line
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    assert parser.parse_args(c["command"][2:]).tool_call_parser == "hermes"  # a choice the engine knows
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                              "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # weights may load for minutes
    assert startup["httpGet"]["path"] == "/ready"  # /health answered as soon as it listened: a hung load passed
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] < pod["terminationGracePeriodSeconds"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_image_pull_secrets_reach_engine_and_router_pods_without_a_new_revision():
    plain = want(spec_of())
    spec = spec_of(imagePullSecrets=[{"name": "regcred"}, {"name": "mirror.creds"}],
                   warmPool={"size": 1}, rollout={"steps": [{"weight": 10}]})
    wanted = want(spec)
    secrets = [{"name": "regcred"}, {"name": "mirror.creds"}]
    assert pod_spec(wanted.stable.deployment)["imagePullSecrets"] == secrets
    assert pod_spec(child(wanted, "Deployment", "chat-router"))["imagePullSecrets"] == secrets
    assert "imagePullSecrets" not in pod_spec(plain.stable.deployment)
    assert "imagePullSecrets" not in pod_spec(child(plain, "Deployment", "chat-router"))
    assert wanted.stable.name == plain.stable.name  # credentials are not a new model: no canary
    with pytest.raises(ValueError, match="regcred: named more than once"):
        spec_of(imagePullSecrets=[{"name": "regcred"}, {"name": "regcred"}])
    for bad in ({"name": "RegCred"}, {"name": ""}, {"secret": "regcred"}):
        with pytest.raises(ValueError):
            spec_of(imagePullSecrets=[bad])


def test_engine_env_is_a_new_revision_and_replaces_kilns_own_by_name():
    plain = want(spec_of(resources={"gpus": 2}, engine={"tensorParallelSize": 2}))
    env = [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "OMP_NUM_THREADS", "value": "8"},
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "EMPTY"}]
    spec = spec_of(resources={"gpus": 2}, engine={"tensorParallelSize": 2, "env": env})
    (c,) = pod_spec(want(spec).stable.deployment)["containers"]
    assert c["env"] == [{"name": "HOME", "value": "/tmp"}, {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
                        {"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "OMP_NUM_THREADS", "value": "8"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token",
                                                                            "optional": False}}},
                        {"name": "EMPTY"}]
    assert want(spec).stable.name != plain.stable.name  # the engine runs differently: a new revision
    assert spec_of(engine={"env": []}).engine.env == [] and want(spec_of(engine={"env": []})).stable.name == \
        want(spec_of()).stable.name  # an empty list is the default: no rollout
    for bad in ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], [{"name": "1BAD"}], [{"name": "A=B"}],
                [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}]):
        with pytest.raises(ValueError):
            spec_of(engine={"env": bad})


def test_a_chat_template_reaches_the_engine_whole_as_a_new_revision():
    # Its backslashes too (the engine decodes an inline template's escapes, as vLLM does).
    template = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | replace('\\n', ' ') }}\\n\n{% endfor %}<|assistant|>\n"
    spec = spec_of(engine={"chatTemplate": template})
    (c,) = pod_spec(want(spec).stable.deployment)["containers"]
    from kiln.engine import server
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    given = parser.parse_args(c["command"][2:]).chat_template
    assert server.read_chat_template(given) == template  # the engine takes it as a template, verbatim
    assert want(spec).stable.name != want(spec_of()).stable.name
    for bad in ("", "x" * 65537):
        with pytest.raises(ValueError):
            spec_of(engine={"chatTemplate": bad})


def test_a_gpu_service_demands_cuda_and_a_cpu_only_one_asks_for_no_gpu():
    c = pod_spec(want(spec_of()).stable.deployment)["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and "--device" not in c["command"]
    # Given GPUs, the engine must use them or refuse to start ("auto" would fall back to the CPU).
    c = pod_spec(want(spec_of(resources={"gpus": 1})).stable.deployment)["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["command"][c["command"].index("--device") + 1] == "cuda"


def test_tensor_parallel_pod_gets_its_gpus_ranks_shared_memory_and_nccl_env():
    from kiln.engine import server
    pod = pod_spec(want(spec_of(engine={"tensorParallelSize": 2}, resources={"gpus": 2})).stable.deployment)
    (c,) = pod["containers"]
    assert c["command"][-2:] == ["--tensor-parallel-size", "2"]
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    assert parser.parse_args(c["command"][2:]).tensor_parallel_size == 2
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    single = pod_spec(want(spec_of(resources={"gpus": 1})).stable.deployment)
    assert "--tensor-parallel-size" not in single["containers"][0]["command"]
    assert "dshm" not in [v["name"] for v in single["volumes"]]


def test_engine_command_is_accepted_by_kiln_serve():
    from kiln.engine import server
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    c = pod_spec(want(spec_of(engine={"maxModelLen": 512, "kvCache": {"prefixCaching": False}}))
                 .stable.deployment)["containers"][0]
    assert c["command"][:2] == ["kiln", "serve"]
    args = parser.parse_args(c["command"][2:])
    # No kvCache.memory: the engine sizes the pool (from GPU memory on a GPU, 1Gi on a CPU).
    assert (args.model, args.port, args.max_model_len, args.kv_cache_memory) == ("smollm2-135m", 8000, 512, None)
    c = pod_spec(want(spec_of(engine={"kvCache": {"memory": "2Gi"}})).stable.deployment)["containers"][0]
    assert parser.parse_args(c["command"][2:]).kv_cache_memory == 2 << 30
    # Tensor-parallel ranks cannot profile a step alone: unset, they keep 1Gi each.
    tp = spec_of(engine={"tensorParallelSize": 2}, resources={"gpus": 2})
    assert parser.parse_args(pod_spec(want(tp).stable.deployment)["containers"][0]["command"][2:]).kv_cache_memory \
        == 1 << 30
    # Values that start with '-' (a served name, a template): argparse took them for flags, exit 2.
    dashed = spec_of(model={"source": "pvc://weights/-v2"}, engine={"chatTemplate": "-{{ messages }}"})
    args = parser.parse_args(pod_spec(want(dashed).stable.deployment)["containers"][0]["command"][2:])
    assert (args.served_model_name, args.chat_template) == ("-v2", "-{{ messages }}")


@pytest.mark.parametrize("source, model_arg, volume", [
    ("pvc://weights/llama/model.gguf", "/models/llama/model.gguf",
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ("pvc://weights", "/models", {"name": "model", "persistentVolumeClaim": {"claimName": "weights",
                                                                            "readOnly": True}}),
    ("hostpath:///data/smollm2", "/data/smollm2", {"name": "model", "hostPath": {"path": "/data/smollm2"}}),
])
def test_model_sources_become_volumes(source, model_arg, volume):
    pod = pod_spec(want(spec_of(model={"source": source})).stable.deployment)
    command = pod["containers"][0]["command"]
    assert command[command.index("--model") + 1] == model_arg
    assert volume in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True and model_arg.startswith(mount["mountPath"])


def test_served_name_defaults_to_the_source_basename():
    assert spec_of(model={"source": "pvc://w/dir/qwen.gguf"}).model.served_name == "qwen"
    assert spec_of(model={"source": "builtin://smollm2-135m", "name": "chat"}).model.served_name == "chat"


def test_revision_changes_with_model_or_engine_only():
    base = revision_name("chat", spec_of())
    assert base.startswith("chat-") and len(base) == len("chat-") + 8
    assert revision_name("chat", spec_of(engine={"maxNumSeqs": 128, "dtype": "auto"})) == base  # defaults
    assert revision_name("chat", spec_of(replicas=5, resources={"gpus": 1})) == base
    assert revision_name("chat", spec_of(engine={"quantization": "int4"})) != base
    assert revision_name("chat", spec_of(model={"source": "builtin://other"})) != base


def test_replicas_follow_spec_within_autoscaling_bounds():
    assert desired_replicas(spec_of(replicas=3)) == 3
    assert desired_replicas(spec_of(replicas=9, autoscaling={"minReplicas": 1, "maxReplicas": 4})) == 4
    assert desired_replicas(spec_of(replicas=0, autoscaling={"minReplicas": 2, "maxReplicas": 4})) == 2
    # mode none: no autoscaler reads the bounds (here only their defaults, 1 and 4), so
    # `kubectl scale isvc --replicas=N` is obeyed, zero and above four included.
    for replicas in (0, 9):
        assert desired_replicas(spec_of(replicas=replicas, autoscaling={"mode": "none"})) == replicas
    # hpa at zero (left there by keda, say): the HPA, whose floor is 1, turns itself off (ScalingDisabled).
    assert desired_replicas(spec_of(replicas=0, autoscaling={"mode": "hpa", "minReplicas": 0})) == 1


def test_leaving_builtin_for_an_hpa_or_keda_hands_its_decision_to_spec_replicas():
    def handed(left: dict, observed: Observed = Observed(), keda: bool = True, **spec) -> int | None:
        given = handover(spec_of(**spec), left, observed, "chat", keda)
        return None if given is None else given.replicas

    left = {"autoscaling": {"replicas": 3, "mode": "stable"}}  # status as the builtin mode left it
    for mode in ("hpa", "keda"):
        assert handed(left, replicas=1, autoscaling={"mode": mode, "maxReplicas": 8}) == 3
        # Within the new bounds: above maxReplicas, or at zero for an HPA (which stops at 0).
        assert handed(left, replicas=1, autoscaling={"mode": mode, "maxReplicas": 2}) == 2
    at_zero = {"autoscaling": {"replicas": 0}}
    assert handed(at_zero, replicas=3, autoscaling={"mode": "hpa", "minReplicas": 0}) == 1
    assert handed(at_zero, replicas=3, autoscaling={"mode": "keda", "minReplicas": 0}) == 0
    # Nothing to hand over: spec.replicas says it already; no builtin decision was left (the pass
    # after the hand-over: status.autoscaling is gone); still builtin; mode none (whose
    # spec.replicas is a person's); keda without KEDA (nothing would take over, nor wake a zero).
    assert handed(left, replicas=3, autoscaling={"mode": "hpa"}) is None
    assert handed({}, replicas=1, autoscaling={"mode": "hpa"}) is None
    assert handed(left, replicas=1, autoscaling={"mode": "builtin"}) is None
    assert handed(left, replicas=1, autoscaling={"mode": "none"}) is None
    assert handed(left, replicas=1) is None
    assert handed(at_zero, keda=False, replicas=1, autoscaling={"mode": "keda", "minReplicas": 0}) is None
    # The scaler is there already (a pass that created it failed before its status write): the
    # count in spec.replicas is the scaler's now, and a second hand-over would undo it.
    for kind, mode in (("HorizontalPodAutoscaler", "hpa"), ("ScaledObject", "keda")):
        scaler = Observed.of({"kind": kind, "metadata": {"name": "chat"}})
        assert handed(left, scaler, replicas=1, autoscaling={"mode": mode}) is None


def test_an_hpa_never_starts_from_zero():
    """An HPA does not act on a target at 0 replicas (ScalingDisabled) and never sets 0 itself: a
    spec.replicas of 0 (KEDA's, at zero, before a switch; mode none's; a manifest's) is raised
    to the HPA's floor, whatever the mode before and whether the HPA exists or not."""
    hpa = Observed.of({"kind": "HorizontalPodAutoscaler", "metadata": {"name": "chat"}})
    for observed in (Observed(), hpa):
        for left in ({}, {"autoscaling": {"replicas": 0}}):
            given = handover(spec_of(replicas=0, autoscaling={"mode": "hpa", "minReplicas": 0}), left, observed,
                             "chat", True)
            assert given is not None and given.replicas == 1 and "floor" in given.why
        assert handover(spec_of(replicas=0, autoscaling={"mode": "hpa", "minReplicas": 2}), {}, observed, "chat",
                        True).replicas == 2
    # KEDA and none take 0 as meant.
    for mode in ("keda", "none"):
        assert handover(spec_of(replicas=0, autoscaling={"mode": mode, "minReplicas": 0}), {}, Observed(), "chat",
                        True) is None


def test_a_draft_model_reaches_the_engine_with_its_volume():
    def engine_of(draft: str, source: str = "builtin://smollm2-135m", tp: int = 1) -> tuple[dict, dict]:
        spec = spec_of(model={"name": "m", "source": source},
                       engine={"tensorParallelSize": tp, "speculative": {"method": "draft", "numTokens": 3, "model": {
                           "name": "d", "source": draft}}}, resources={"gpus": tp})
        pod = pod_spec(want(spec).stable.deployment)
        return pod, pod["containers"][0]

    pod, c = engine_of("pvc://drafts/smol/model.gguf", source="pvc://weights/llama")
    config = SpeculativeConfig.from_json(c["command"][c["command"].index("--speculative-config") + 1])
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/draft-model/smol/model.gguf",
                                                                            3)
    assert c["command"][c["command"].index("--model") + 1] == "/models/llama"
    assert {"name": "draft-model", "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}} in pod["volumes"]
    assert {"name": "draft-model", "mountPath": "/draft-model", "readOnly": True} in c["volumeMounts"]
    # A draft on the target's claim is read through the target's mount: the claim is mounted once.
    pod, c = engine_of("pvc://weights/drafts/smol.gguf", source="pvc://weights/llama")
    assert SpeculativeConfig.from_json(c["command"][-1]).model == "/models/drafts/smol.gguf"
    assert [v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == ["model"]
    # A built-in draft needs no volume; one on the target's own host path is mounted once.
    pod, c = engine_of("builtin://smollm2-135m")
    assert '"model": "smollm2-135m"' in c["command"][-1] and "draft-model" not in str(pod["volumes"])
    pod, c = engine_of("hostpath:///srv/models", source="hostpath:///srv/models")
    assert [m["mountPath"] for m in c["volumeMounts"]].count("/srv/models") == 1
    assert SpeculativeConfig.from_json(c["command"][-1]).model == "/srv/models"
    # A tensor-parallel target gets its draft too (the engine runs it whole on rank 0).
    pod, c = engine_of("pvc://drafts/smol/model.gguf", tp=2)
    command = c["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    config = SpeculativeConfig.from_json(command[command.index("--speculative-config") + 1])
    assert (config.method, config.model) == ("draft_model", "/draft-model/smol/model.gguf")
    assert {"name": "draft-model", "mountPath": "/draft-model", "readOnly": True} in c["volumeMounts"]


def deployment(name: str, generation: int = 1, ready: int = 0, replicas: int = 1, updated: int | None = None,
               conditions: list | None = None, component: str = "engine") -> dict:
    """A Deployment as the API server reports it (only the fields the operator reads)."""
    return {"kind": "Deployment",
            "metadata": {"name": name, "generation": generation,
                         "labels": {"kiln.dev/inferenceservice": "chat", "kiln.dev/component": component},
                         "annotations": {ANNOTATION_QUANTIZATION: "none"}},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": generation, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated,
                       "conditions": conditions or []}}


def status_for(spec, deployments, previous=None, now="2026-01-01T00:00:00Z", router="ready") -> dict:
    routers = {"ready": [deployment("chat-router", ready=1, component="router")],
               "unready": [deployment("chat-router", component="router")], "none": []}
    observed = Observed.of(*deployments, *routers[router])
    return summarize(generation=4, desired=want(spec, observed), observed=observed,
                     previous=previous or {}, url="http://chat.ml.svc:8000/v1", selector="s", now=now)


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_reports_what_deployments_report():
    spec = spec_of(replicas=2)
    rev = revision_name("chat", spec)
    loading = status_for(spec, [deployment(rev, replicas=2, ready=0)])
    assert conditions(loading)["Ready"] == ("False", "ReplicasNotReady")
    assert conditions(loading)["ModelLoaded"] == ("False", "Loading")
    half = status_for(spec, [deployment(rev, replicas=2, ready=1), deployment("chat-old", ready=1)])
    assert conditions(half)["ModelLoaded"] == ("True", "Loaded")
    assert conditions(half)["WorkloadReady"] == ("False", "ReplicasNotReady")
    assert [(r["name"], r["role"]) for r in half["revisions"]] == [(rev, "stable"), ("chat-old", "old")]
    assert (half["replicas"], half["readyReplicas"], half["desiredReplicas"]) == (3, 2, 2)
    ready = status_for(spec, [deployment(rev, replicas=2, ready=2), deployment("chat-old", ready=1)])
    assert conditions(ready)["Ready"] == ("True", "Serving")
    # At full strength the old revision is no longer desired (this pass deletes it).
    assert [r["role"] for r in ready["revisions"]] == ["stable"]
    assert all(c["observedGeneration"] == 4 for c in ready["conditions"])
    assert list(conditions(ready)) == ["Ready", "WorkloadReady", "ModelLoaded", "RouteReady"]


def test_ready_waits_for_the_router():
    spec = spec_of()
    engines = [deployment(revision_name("chat", spec), ready=1)]
    assert conditions(status_for(spec, engines, router="none"))["Ready"] == ("False", "Creating")
    unready = conditions(status_for(spec, engines, router="unready"))
    assert unready["Ready"] == ("False", "RouterNotReady") and unready["WorkloadReady"][0] == "True"
    assert conditions(status_for(spec, engines))["RouteReady"] == ("True", "RouterReady")


def test_unsettled_or_stuck_deployment_is_not_ready():
    spec = spec_of()
    rev = revision_name("chat", spec)
    stale = deployment(rev, ready=1)
    stale["metadata"]["generation"] = 2  # the controller has not seen the latest template yet
    assert conditions(status_for(spec, [stale]))["WorkloadReady"][0] == "False"
    stuck = deployment(rev, conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded",
                                         "message": "exceeded its progress deadline"}])
    assert conditions(status_for(spec, [stuck]))["Ready"] == ("False", "ProgressDeadlineExceeded")
    assert conditions(status_for(spec, []))["Ready"] == ("False", "Creating")
    refused = deployment(rev, conditions=[{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                           "message": 'pods "x" is forbidden: exceeded quota: gpus'}])
    status = status_for(spec, [refused])
    assert conditions(status)["Ready"] == ("False", "FailedCreate")
    assert "exceeded quota" in next(c["message"] for c in status["conditions"] if c["type"] == "Ready")


def engine_pod(name: str, revision: str, container: dict) -> dict:
    """An engine pod as the API server reports it, with its container's status from the kubelet."""
    return {"kind": "Pod", "metadata": {"name": name, "labels": {"kiln.dev/component": "engine",
                                                                 LABEL_REVISION: revision}},
            "status": {"containerStatuses": [{"name": "engine", **container}]}}


def test_a_failing_engine_says_why_in_model_loaded_and_ready():
    spec = spec_of(replicas=2)
    rev = revision_name("chat", spec)
    log = "INFO loading\n2026-11-27 17:20:55,549 ERROR kiln.serve: bad configuration: --chat-template: the " \
          "template does not compile: unexpected end of template\n\n"
    crashed = {"ready": False, "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": log}}}
    starting = {"ready": False, "restartCount": 0, "state": {"running": {}}}
    status = status_for(spec, [deployment(rev, replicas=2), engine_pod("chat-b", rev, starting),
                               engine_pod("chat-c", rev, crashed)])
    why = ("pod chat-c: the engine exited with code 2 (Error): ERROR kiln.serve: bad configuration: "
           "--chat-template: the template does not compile: unexpected end of template")
    model = next(c for c in status["conditions"] if c["type"] == "ModelLoaded")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (model["status"], model["reason"], model["message"]) == ("False", "EngineFailing", why)
    assert (ready["reason"], ready["message"]) == ("EngineFailing", why)
    # The next restart, logging the same error at another time, is no news: no second Warning Event.
    relogged = {"exitCode": 2, "reason": "Error", "message": log.replace("17:20:55,549", "17:21:03,315")}
    again = status_for(spec, [deployment(rev, replicas=2), engine_pod("chat-c", rev, {
        **crashed, "restartCount": 4, "lastState": {"terminated": relogged}})], previous=status)
    assert not transitions(status, again)
    oom = {"ready": False, "state": {"running": {}}, "lastState": {"terminated": {"exitCode": 137,
                                                                                    "reason": "OOMKilled"}}}
    assert next(c for c in status_for(spec, [deployment(rev), engine_pod("chat-d", rev, oom)])["conditions"]
                if c["type"] == "ModelLoaded")["message"] == "pod chat-d: the engine exited with code 137 (OOMKilled)"
    # Another revision's crash, a clean exit, or a loaded replica say nothing of this one.
    for quiet in ([engine_pod("old", "chat-old", crashed)],
                  [engine_pod("chat-e", rev, {**crashed, "lastState": {"terminated": {"exitCode": 0}}})]):
        assert conditions(status_for(spec, [deployment(rev), *quiet]))["ModelLoaded"] == ("False", "Loading")
    assert conditions(status_for(spec, [deployment(rev, ready=1), engine_pod("chat-c", rev, crashed)]))[
        "ModelLoaded"] == ("True", "Loaded")


def test_an_engine_that_cannot_start_says_why_as_its_kubelet_does():
    """A typo in the image, a Secret the env names that is missing: not "Loading" for ever."""
    spec = spec_of()
    rev = revision_name("chat", spec)
    pull = "pod chat-a: the engine cannot start: image ghcr.io/kiln/engine:0.1.O cannot be pulled " \
           "(kubectl describe pod chat-a shows the registry's error)"
    for reason, message, why in (
            ("ImagePullBackOff", 'Back-off pulling image "ghcr.io/kiln/engine:0.1.O"', pull),
            ("ErrImagePull", "manifest unknown", pull),  # the kubelet alternates the two: one message, one Event
            ("CreateContainerConfigError", 'secret "hf-token" not found',
             'pod chat-a: the engine cannot start: CreateContainerConfigError: secret "hf-token" not found')):
        stuck = {"ready": False, "restartCount": 0, "image": "ghcr.io/kiln/engine:0.1.O",
                 "state": {"waiting": {"reason": reason, "message": message}}}
        status = status_for(spec, [deployment(rev), engine_pod("chat-a", rev, stuck)])
        model = next(c for c in status["conditions"] if c["type"] == "ModelLoaded")
        assert (model["status"], model["reason"], model["message"]) == ("False", "EngineFailing", why)
        assert conditions(status)["Ready"] == ("False", "EngineFailing")
    creating = {"ready": False, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}
    assert conditions(status_for(spec, [deployment(rev), engine_pod("chat-a", rev, creating)]))[
        "ModelLoaded"] == ("False", "Loading")  # on its way


def test_transition_time_holds_while_status_holds():
    spec = spec_of()
    rev = revision_name("chat", spec)
    first = status_for(spec, [deployment(rev)], now="t1")
    second = status_for(spec, [deployment(rev)], previous=first, now="t2")
    assert {c["lastTransitionTime"] for c in second["conditions"]} == {"t1"}
    assert transitions(first, second) == []
    third = status_for(spec, [deployment(rev, ready=1)], previous=copy.deepcopy(second), now="t3")
    changed = {c["type"]: c["lastTransitionTime"] for c in transitions(second, third)}
    assert changed == {"Ready": "t3", "WorkloadReady": "t3", "ModelLoaded": "t3"}


def test_old_revisions_retire_only_once_the_new_one_is_ready():
    spec = spec_of(replicas=2)
    rev = revision_name("chat", spec)
    old = deployment("chat-0ld0ld00", ready=2, replicas=2)
    starting = want(spec, Observed.of(deployment(rev, ready=1, replicas=2), old))
    assert [(r.name, r.role, r.deployment is None) for r in starting.revisions] == \
        [(rev, "stable", False), ("chat-0ld0ld00", "old", True)]  # an old revision is left as it is
    assert [r.name for r in want(spec, Observed.of(deployment(rev, ready=2, replicas=2), old)).revisions] == [rev]


def test_replicas_belong_to_one_writer():
    spec = spec_of(replicas=3)
    rev = revision_name("chat", spec)
    assert want(spec, Observed.of(deployment(rev, replicas=5))).stable.replicas == 3  # spec.replicas rules
    # An HPA or KEDA scales through the InferenceService's /scale: spec.replicas, kept in bounds.
    hpa = spec_of(replicas=9, autoscaling={"mode": "hpa", "minReplicas": 1, "maxReplicas": 8})
    assert want(hpa, Observed.of(deployment(rev, replicas=5))).stable.replicas == 8
    # The builtin autoscaler's decision rules; before its first one, what runs stays, and a new
    # revision starts at today's capacity.
    scaled = spec_of(replicas=3, autoscaling={"mode": "builtin", "minReplicas": 1, "maxReplicas": 8})
    rev = revision_name("chat", scaled)
    assert desired(OWNER, scaled, Observed.of(deployment(rev, replicas=5)), IMAGE, autoscaled=2).stable.replicas == 2
    assert want(scaled, Observed.of(deployment(rev, replicas=5))).stable.replicas == 5
    assert want(scaled, Observed.of(deployment("chat-0ld0ld00", replicas=6))).stable.replicas == 6
    assert want(scaled).stable.replicas == 3
    status = status_for(scaled, [deployment(rev, replicas=5, ready=5)])
    assert status["desiredReplicas"] == 5 and conditions(status)["Ready"] == ("True", "Serving")


def test_scaled_to_zero_is_ready_to_serve():
    spec = spec_of(replicas=0)
    status = status_for(spec, [deployment(revision_name("chat", spec), replicas=0)])
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")  # the router holds requests
    assert conditions(status)["ModelLoaded"] == ("Unknown", "ScaledToZero")
    assert conditions(status_for(spec, [deployment(revision_name("chat", spec), replicas=0)],
                                 router="unready"))["Ready"] == ("False", "RouterNotReady")
    # A warm standby is loaded but serves nothing: still at zero, not Serving.
    pooled = spec_of(replicas=0, warmPool={"size": 1})
    status = status_for(pooled, [deployment(revision_name("chat", pooled), replicas=1, ready=1)])
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")
    assert conditions(status)["ModelLoaded"] == ("Unknown", "ScaledToZero")
    serving = spec_of(replicas=1, warmPool={"size": 1})
    status = status_for(serving, [deployment(revision_name("chat", serving), replicas=2, ready=2)])
    assert conditions(status)["Ready"] == ("True", "Serving")


def test_a_short_warm_pool_keeps_nothing_from_serving_and_a_failing_one_is_said_at_zero():
    # A promotion took a standby; its replacement loads: 2 serve, the pool is 1 of 2.
    spec = spec_of(replicas=2, warmPool={"size": 2})
    rev = revision_name("chat", spec)
    status = status_for(spec, [deployment(rev, replicas=4, ready=3)])
    assert conditions(status)["Ready"] == ("True", "Serving") and status["desiredReplicas"] == 2
    assert conditions(status_for(spec, [deployment(rev, replicas=4, ready=1)]))["Ready"] == (
        "False", "ReplicasNotReady")
    # A full pool: the message counts the serving replicas, not "4/2" with the standbys.
    standbys = [{"kind": "Pod", "metadata": {"name": f"s{i}", "labels": {
        "kiln.dev/component": "engine", LABEL_REVISION: rev, "kiln.dev/serving": "false"}},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}} for i in range(2)]
    full = next(c for c in status_for(spec, [deployment(rev, replicas=4, ready=4), *standbys])["conditions"]
                if c["type"] == "WorkloadReady")
    assert full["message"] == f"2/2 replicas of {rev} ready"
    # The old revision goes once the new one serves at full strength, not once its pool is full too
    # (the pool may need the GPUs the old revision holds).
    fresh = want(spec, Observed.of(deployment(rev, replicas=4, ready=2), deployment("chat-0ld0ld00", replicas=2,
                                                                                     ready=2)))
    assert [r.name for r in fresh.revisions] == [rev]
    short = want(spec, Observed.of(deployment(rev, replicas=4, ready=1), deployment("chat-0ld0ld00", replicas=2,
                                                                                     ready=2)))
    assert [r.name for r in short.revisions] == [rev, "chat-0ld0ld00"]
    # At zero, a standby that cannot load is what the first request would meet: said now.
    pooled = spec_of(replicas=0, warmPool={"size": 1})
    rev = revision_name("chat", pooled)
    crashed = {"ready": False, "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "no such model\n"}}}
    status = status_for(pooled, [deployment(rev, replicas=1), engine_pod("chat-s", rev, crashed)])
    assert conditions(status)["ModelLoaded"] == ("False", "EngineFailing")
    assert conditions(status)["Ready"] == ("False", "EngineFailing")
    going = engine_pod("chat-s", rev, crashed)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # a scale-down's pod: no news
    assert conditions(status_for(pooled, [deployment(rev, replicas=0), going]))["Ready"] == ("True", "ScaledToZero")


def test_standbys_a_quota_refuses_keep_nothing_from_serving():
    """The Deployment's ReplicaFailure (or a progress deadline) concerns its standbys once every
    serving replica is ready: Ready stays True, at zero too; without them ready it is the news."""
    quota = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
              "message": 'pods "x" is forbidden: exceeded quota: gpus'}]
    spec = spec_of(replicas=1, warmPool={"size": 2})
    rev = revision_name("chat", spec)
    status = status_for(spec, [deployment(rev, replicas=1, ready=1, conditions=quota)])
    assert conditions(status)["Ready"] == ("True", "Serving")
    status = status_for(spec, [deployment(rev, replicas=1, ready=0, conditions=quota)])
    assert conditions(status)["Ready"] == ("False", "FailedCreate")
    deadline = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "exceeded"}]
    pooled = spec_of(replicas=0, warmPool={"size": 1})
    status = status_for(pooled, [deployment(revision_name("chat", pooled), replicas=0, conditions=deadline)])
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")


def test_an_old_revision_gives_up_its_warm_pool_while_it_serves_on():
    """No standby of an old revision is ever promoted: scaled to the pods that serve, its
    ReplicaSet deletes the standbys, whose GPUs the new revision's pods may wait for."""
    spec = spec_of(replicas=2, warmPool={"size": 2})
    old = deployment("chat-0ld0ld00", replicas=4, ready=4)
    old["spec"]["template"] = {"metadata": {"labels": {"kiln.dev/serving": "false"}}}

    def pod(name: str, serving: bool, ready: bool = True) -> dict:
        return {"kind": "Pod", "metadata": {"name": name, "labels": {
            "kiln.dev/component": "engine", LABEL_REVISION: "chat-0ld0ld00", "kiln.dev/serving": str(serving).lower()}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}}
    new = deployment(revision_name("chat", spec), replicas=4, ready=1)
    observed = Observed.of(old, *(pod(f"s{i}", True) for i in range(2)), *(pod(f"w{i}", False) for i in range(2)), new)
    olds = [r for r in want(spec, observed).revisions if r.role == "old"]
    assert [(r.name, r.replicas) for r in olds] == [("chat-0ld0ld00", 2)]
    # A serving pod not ready would go before a ready standby (the ReplicaSet's order): not yet.
    observed = Observed.of(old, pod("s0", True), pod("s1", True, ready=False), pod("w0", False), new)
    assert [r.replicas for r in want(spec, observed).revisions if r.role == "old"] == [None]
    # One without a pool is left at its size, as before.
    plain = Observed.of(deployment("chat-0ld0ld00", replicas=3, ready=3),
                        deployment(revision_name("chat", spec), replicas=4, ready=1))
    assert [r.replicas for r in want(spec, plain).revisions if r.role == "old"] == [None]


def test_an_error_is_news_once_per_message():
    from kiln.operator.status import invalid
    first = invalid({}, 1, "InvalidSpec", "bad field x", "t1")
    assert [(c["type"], c["reason"]) for c in transitions({}, first)] == [("Ready", "InvalidSpec")]
    assert transitions(first, invalid(first, 1, "InvalidSpec", "bad field x", "t2")) == []
    assert len(transitions(first, invalid(first, 2, "InvalidSpec", "bad field y", "t2"))) == 1


def test_a_scaler_failure_is_a_warning_event():
    """An HPA without its metrics adapter said so only in a Normal Event (its reasons are not ours)."""
    from kiln.operator.scaling import scaler_condition
    from kiln.operator.status import event_type
    hpa = {"status": {"conditions": [{"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
                                     {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
                                      "message": "unable to get metric kiln:num_requests_load"}]}}
    assert event_type(scaler_condition(hpa, "HorizontalPodAutoscaler")) == "Warning"
    hpa["status"]["conditions"][1].update(status="True", reason="ValidMetricFound")
    assert event_type(scaler_condition(hpa, "HorizontalPodAutoscaler")) == "Normal"


def test_a_refused_child_keeps_readys_transition_time_and_a_bad_spec_claims_no_other_condition():
    """Rejected was stamped against the freshly summarized Ready=True: its time moved, and status
    was written, on every pass. And InvalidSpec gave the kept conditions (CanaryReady=True, say)
    the new generation, which `kubectl wait` then took for the new spec's verdict."""
    from kiln.operator.status import invalid
    spec = spec_of(replicas=2)
    serving = [deployment(revision_name("chat", spec), replicas=2, ready=2)]
    stored = invalid(status_for(spec, serving), 4, "Rejected", "Service chat is not ours", "t1")
    again = invalid(status_for(spec, serving, previous=stored, now="t2"), 4, "Rejected",
                    "Service chat is not ours", "t2", stored=stored)
    ready = {c["type"]: c for c in again["conditions"]}["Ready"]
    assert (ready["status"], ready["lastTransitionTime"]) == ("False", "t1") and transitions(stored, again) == []
    bad = invalid(stored, 5, "InvalidSpec", "bad field x", "t3")
    generations = {c["type"]: c["observedGeneration"] for c in bad["conditions"]}
    assert generations.pop("Ready") == 5 and set(generations.values()) == {4}


def test_operator_cli_rejects_bad_input(tmp_path, monkeypatch, capsys):
    from kiln import cli
    for interval in ("0", "nan", "inf"):
        assert cli.main(["operator", "--interval", interval]) == 2
        assert "--interval must be positive" in capsys.readouterr().err
    with socket.socket() as taken:  # a port another process holds: one line, not a traceback
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["operator", "--metrics-port", str(port)]) == 1
        assert f"cannot serve metrics on port {port}" in capsys.readouterr().err
        assert cli.main(["operator", "--liveness", f"http://:{port}/healthz"]) == 1
        assert f"cannot serve liveness on http://:{port}/healthz" in capsys.readouterr().err
    assert cli.main(["operator", "--pod-annotation", "no-equals-sign"]) == 2
    assert "--pod-annotation takes KEY=VALUE" in capsys.readouterr().err
    # Said before connecting: the API server would refuse each object carrying them, and kopf
    # raised the liveness URL's scheme in a traceback once running.
    for argv, said in ((["--pod-annotation", "bad key=1"], "--pod-annotation: 'bad key' is not a Kubernetes key"),
                       (["--gpu-node-selector", "pool=v/x"], "--gpu-node-selector: 'v/x' is not a label value"),
                       (["--cpu-toleration=-bad:NoSchedule"], "--cpu-toleration: '-bad' is not a Kubernetes key"),
                       (["--liveness", "foo"], "--liveness takes http://[HOST]:PORT/PATH"),
                       (["--liveness", "http://0.0.0.0:99999/healthz"], "--liveness takes http://[HOST]:PORT/PATH"),
                       (["--liveness", "https://:8080/healthz"], "--liveness takes http://[HOST]:PORT/PATH"),
                       (["--leader-elect", "--lease-name", "Kiln_Operator"], "--lease-name 'Kiln_Operator' is not"),
                       (["--leader-elect", "--lease-namespace", "kiln system"], "--lease-namespace 'kiln system' is not"),
                       (["--namespace", "Bad_NS"], "--namespace 'Bad_NS' is not a namespace name"),
                       (["-n", "ok", "--namespace="], "--namespace '' is not a namespace name"),
                       (["--engine-image="], "--engine-image '' is not an image reference"),
                       (["--prometheus-url", "notaurl"], "--prometheus-url takes http(s)://HOST[:PORT]")):
        assert cli.main(["operator", *argv]) == 2, argv
        assert said in capsys.readouterr().err, argv
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["operator"]) == 1
    assert "set KUBECONFIG or run in a pod" in capsys.readouterr().err
    (tmp_path / "text").write_text("just words\n")
    (tmp_path / "broken").write_text("clusters: [\n")
    for bad in ("text", "broken", "."):  # no mapping, no YAML, a folder: one line naming it, no traceback
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / bad))
        assert cli.main(["operator"]) == 1, bad
        err = capsys.readouterr().err
        assert str(tmp_path / bad) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_router_replicas_come_from_the_spec_with_a_budget_and_a_graceful_stop():
    wanted = want(spec_of(router={"replicas": 2}))
    router, pdb = child(wanted, "Deployment", "chat-router"), child(wanted, "PodDisruptionBudget", "chat-router")
    assert router["spec"]["replicas"] == 2
    assert pdb["spec"]["selector"]["matchLabels"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 1
    pod = pod_spec(router)
    # Endpoints drop it during the preStop pause; the shutdown after SIGTERM fits in the grace period.
    assert pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] + 25 < pod["terminationGracePeriodSeconds"]
    assert want(spec_of()).objects() and child(want(spec_of()), "Deployment", "chat-router")["spec"]["replicas"] == 1
    with pytest.raises(ValueError):
        spec_of(router={"replicas": 0})


def test_a_router_holds_requests_as_long_as_the_service_says():
    """A model that loads for longer than the router's 5 minutes answered every held request 503
    before a replica from zero served it: autoscaling.activationTimeout sets the hold."""
    from kiln.router.main import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def held(**autoscaling) -> float:
        command = pod_spec(child(want(spec_of(autoscaling=autoscaling)), "Deployment", "chat-router"))["containers"][0][
            "command"]
        return parser.parse_args(command[2:]).activation_timeout
    assert held() == 300.0  # the router's default
    assert held(minReplicas=0, activationTimeout="20m") == 1200.0 and held(activationTimeout="1m30s") == 90.0
    for bad in ("0s", "500ms"):
        with pytest.raises(ValueError, match="activationTimeout must be at least 1s"):
            spec_of(autoscaling={"activationTimeout": bad})
    with pytest.raises(ValueError, match="must be a duration"):
        spec_of(autoscaling={"activationTimeout": "10"})


def test_lora_adapters_reach_the_engine_with_their_volumes():
    engine = {"maxLoras": 3, "maxLoraRank": 64,
              "adapters": [{"name": "sql", "source": "pvc://loras/sql"}, {"name": "poet", "source": "pvc://loras"},
                           {"name": "same-dir", "source": "hostpath:///srv/base"}]}
    spec = spec_of(model={"name": "m", "source": "hostpath:///srv/base"}, engine=engine)
    pod = pod_spec(want(spec).stable.deployment)
    c = pod["containers"][0]
    command = c["command"]
    # poet's claim is sql's: mounted once, at sql's place (one claim in two volumes may never mount).
    assert command[command.index("--lora-modules") + 1:] == ["sql=/adapters/0/sql", "poet=/adapters/0",
                                                             "same-dir=/srv/base"]
    assert "--enable-lora" in command
    assert command[command.index("--max-loras") + 1] == "3" and command[command.index("--max-lora-rank") + 1] == "64"
    assert {"name": "adapter-0", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}} in pod["volumes"]
    assert [v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]].count("loras") == 1
    assert "adapter-1" not in [m["name"] for m in c["volumeMounts"]]
    assert [m["mountPath"] for m in c["volumeMounts"]].count("/srv/base") == 1  # mounted once for both
    assert len({v["name"] for v in pod["volumes"]}) == len(pod["volumes"])
    # The engine reads the flags as written here.
    from kiln.engine.server import add_arguments
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(command[2:])
    assert args.enable_lora and args.lora_modules == [("sql", "/adapters/0/sql"), ("poet", "/adapters/0"),
                                                      ("same-dir", "/srv/base")]
    # With tensor parallelism the same adapters and flags, beside --tensor-parallel-size.
    tp = spec_of(model={"name": "m", "source": "hostpath:///srv/base"}, engine={**engine, "tensorParallelSize": 2},
                 resources={"gpus": 2})
    tp_args = parser.parse_args(pod_spec(want(tp).stable.deployment)["containers"][0]["command"][2:])
    assert (tp_args.tensor_parallel_size, tp_args.enable_lora, tp_args.lora_modules) == (2, True, args.lora_modules)
    # An adapter is part of the revision: adding one rolls out; none renders no LoRA flags.
    assert revision_name("x", spec) != revision_name("x", spec_of(model={"name": "m", "source": "hostpath:///srv/base"}))
    assert "--enable-lora" not in pod_spec(want(spec_of()).stable.deployment)["containers"][0]["command"]


@pytest.mark.parametrize("engine, model, error", [
    ({"adapters": [{"name": "smollm2-135m", "source": "pvc://c"}]}, {}, "the model's own name"),
    ({"adapters": [{"name": "chat", "source": "pvc://c"}]}, {"name": "chat"}, "the model's own name"),
    ({"adapters": [{"name": "a", "source": "pvc://c"}, {"name": "a", "source": "pvc://d"}]}, {}, "more than once"),
    ({"adapters": [{"name": "a b", "source": "pvc://c"}]}, {}, "pattern"),
    ({"maxLoras": 0}, {}, "greater than or equal to 1"),
])
def test_bad_adapters_are_refused_before_any_pod(engine, model, error):
    with pytest.raises(ValueError, match=error):
        spec_of(model={"source": "builtin://smollm2-135m", **model}, engine=engine)


def read_through(pod: dict) -> dict[str, dict]:
    """Each path the engine command names (model, draft, adapters) -> the volume it is read
    through: the one mounted deepest above it."""
    c = pod["containers"][0]
    command = c["command"]
    paths = [command[command.index("--model") + 1]]
    if "--speculative-config" in command:
        paths.append(SpeculativeConfig.from_json(command[command.index("--speculative-config") + 1]).model)
    if "--lora-modules" in command:
        paths += [entry.split("=", 1)[1] for entry in command[command.index("--lora-modules") + 1:]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    reads = {}
    for path in paths:
        above = [m for m in c["volumeMounts"] if PurePosixPath(path).is_relative_to(m["mountPath"])]
        reads[path] = volumes[max(above, key=lambda m: len(PurePosixPath(m["mountPath"]).parts))["name"]]
    return reads


@pytest.mark.parametrize("model, engine, field, at", [  # at: where the other volume is mounted
    # A host folder where the model's claim is mounted: its volume was dropped, and the engine read
    # the claim's root as the adapter or the draft, silently.
    ("pvc://weights/llama", {"adapters": [{"name": "a", "source": "hostpath:///models"}]},
     "engine.adapters[0].source", "/models"),
    ("pvc://weights/llama",
     {"speculative": {"method": "draft", "model": {"name": "d", "source": "hostpath:///models"}}},
     "engine.speculative.model.source", "/models"),
    # ... or below it, over the folder the model is read from; and a claim where a host folder is.
    ("pvc://weights/llama", {"adapters": [{"name": "a", "source": "hostpath:///models/llama"}]},
     "model.source", "/models/llama"),
    ("hostpath:///adapters/0", {"adapters": [{"name": "a", "source": "pvc://loras/sql"}]},
     "engine.adapters[0].source", "/adapters/0"),
    # The engine's own /tmp (and /dev/shm): mounted twice, a Deployment the API server refuses.
    ("hostpath:///tmp", {}, "model.source", "/tmp"),
    ("hostpath:///dev/shm/", {}, "model.source", "/dev/shm"),
])
def test_sources_mounted_over_one_another_are_refused(model, engine, field, at):
    from kiln.operator.stored import parse_spec
    body = {"spec": {"model": {"name": "m", "source": model}, "engine": engine}}
    with pytest.raises(ValueError, match=rf"{re.escape(field)} .* is read at \S+, where .* is mounted \({at}\)"):
        parse_spec(body)  # InvalidSpec in the status, not a Deployment
    # Nor does a spec that skipped validation render one.
    unchecked = spec_of(model={"name": "m", "source": "builtin://smollm2-135m"})
    unchecked = unchecked.model_copy(update={"model": ModelSpec(name="m", source=model),
                                             "engine": Engine.model_validate(engine)})
    with pytest.raises(ValueError, match="is read at"):
        want(unchecked)


def test_every_source_is_read_through_its_own_volume():
    draft = {"method": "draft", "model": {"name": "d", "source": "hostpath:///srv/draft"}}
    adapters = [{"name": "host", "source": "hostpath:///srv/lora"},
                {"name": "same-claim", "source": "pvc://weights/loras/sql"},  # through the model's mount
                {"name": "scratch", "source": "hostpath:///tmp/kiln/lora"}]  # under /tmp, as e2e's folders are
    spec = spec_of(model={"name": "m", "source": "pvc://weights/llama"}, resources={"gpus": 2},
                   engine={"tensorParallelSize": 2, "speculative": draft, "adapters": adapters})
    pod = pod_spec(want(spec).stable.deployment)
    paths = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert len(set(paths)) == len(paths) and {"/tmp", "/dev/shm"} <= set(paths)
    weights = {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    assert {path: {k: v for k, v in volume.items() if k != "name"} for path, volume in read_through(pod).items()} == {
        "/models/llama": weights, "/models/loras/sql": weights, "/srv/draft": {"hostPath": {"path": "/srv/draft"}},
        "/srv/lora": {"hostPath": {"path": "/srv/lora"}},
        "/tmp/kiln/lora": {"hostPath": {"path": "/tmp/kiln/lora"}}}
    # One host folder named twice is mounted once; a host folder inside another is the node's same files.
    spec = spec_of(model={"name": "m", "source": "hostpath:///srv/base"},
                   engine={"adapters": [{"name": "same", "source": "hostpath:///srv/base"},
                                        {"name": "inner", "source": "hostpath:///srv/base/lora"}]})
    pod = pod_spec(want(spec).stable.deployment)
    paths = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert len(set(paths)) == len(paths)
    assert {path: volume["hostPath"]["path"] for path, volume in read_through(pod).items()} == {
        "/srv/base": "/srv/base", "/srv/base/lora": "/srv/base/lora"}
