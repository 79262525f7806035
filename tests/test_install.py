"""The install paths besides `kubectl apply -k manifests/` (tests/test_operator.py): the kustomize
overlays manifests/overlays/{cpu,gpu} and the Helm chart charts/kiln.

helm (built from the Go module proxy by `kiln local build`) lints and renders the chart; what
it renders, and what kustomize renders for the overlays, goes to the local API server with a
server-side dry run (admission and schema validation run, nothing is stored). Each value of
the chart is shown to change what it should."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.local import build
from kiln.operator import images, main
from kiln.operator.models import InferenceServiceSpec
from kiln.operator.placement import placed
from kiln.operator.render import Owner, render_deployment

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kiln"
NAMESPACE = "kiln-system"
KUBE_VERSION = "1.37.1"  # the local control plane's (helm template assumes v1.20 unless told)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(build.binary("helm")), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def template(values: dict[str, Any] | None = None, tmp_path: Path | None = None, crds: bool = False) -> str:
    args = ["template", "kiln", str(CHART), "-n", NAMESPACE, "--kube-version", KUBE_VERSION,
            *(["--include-crds"] if crds else [])]
    if values:
        assert tmp_path is not None
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
        args += ["-f", str(tmp_path / "values.yaml")]
    return helm(*args).stdout


def objects(text: str) -> dict[tuple[str, str, str], dict]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}


def rendered(values: dict[str, Any], tmp_path: Path) -> dict[tuple[str, str, str], dict]:
    return objects(template(values, tmp_path))


def operator_container(objs: dict) -> dict:
    return objs[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["template"]["spec"]["containers"][0]


def kustomize(kubectl, path: Path) -> str:
    return kubectl("kustomize", str(path)).stdout


def test_helm_lint_passes() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in done.stdout


def test_the_charts_crd_is_byte_identical_to_crds() -> None:
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart_crds == ["inferenceservices.kiln.dev.yaml"]  # helm applies every file there
    assert (CHART / "crds" / chart_crds[0]).read_bytes() == (REPO / "crds" / chart_crds[0]).read_bytes()


def test_the_chart_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == images.version()
    assert operator_container(objects(template()))["image"] == images.image("operator")


def test_the_chart_installs_what_manifests_install(kubectl) -> None:
    """Defaults: the same objects as `kubectl apply -k manifests/` but the Namespace (Helm's
    release namespace), labels aside."""
    def unlabelled(objs: dict) -> dict:
        for obj in objs.values():
            obj["metadata"].pop("labels", None)
        return objs
    chart = unlabelled(objects(template(crds=True)))
    manifests = unlabelled(objects(kustomize(kubectl, REPO / "manifests")))
    manifests.pop(("Namespace", "", NAMESPACE))
    assert chart.keys() == manifests.keys()
    for key, obj in manifests.items():
        assert chart[key] == obj, key


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["default"], "operator": {"replicas": 1,
                                           "leaderElection": False}, "engine": {"gpu": {"tolerations":
                                           ["nvidia.com/gpu:NoSchedule"]}}}], ids=["defaults", "changed"])
def test_the_rendered_chart_passes_a_server_side_dry_run(kubectl, kiln_installed, tmp_path, values) -> None:
    done = kubectl("apply", "--dry-run=server", "-f", "-", input=template(values, tmp_path, crds=True))
    assert "(server dry run)" in done.stdout and "deployment.apps/kiln-operator" in done.stdout


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_overlays_pass_a_server_side_dry_run(kubectl, kiln_installed, overlay) -> None:
    text = kustomize(kubectl, REPO / "manifests" / "overlays" / overlay)
    done = kubectl("apply", "--dry-run=server", "-f", "-", input=text)
    assert "deployment.apps/kiln-operator configured (server dry run)" in done.stdout


def engine_pod(command: list[str], gpus: int) -> dict:
    """The pod spec the operator started with `command` gives an engine with `gpus` GPUs."""
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    where = main.placements(parser.parse_args(command[2:]))
    spec = InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"},
                                                "resources": {"gpus": gpus}})
    return render_deployment(Owner("chat", "ml", "uid"), placed(spec, where), "engine:test")["spec"]["template"]["spec"]


def test_the_gpu_overlay_sends_gpu_engines_to_tolerated_gpu_nodes(kubectl) -> None:
    command = operator_container(objects(kustomize(kubectl, REPO / "manifests/overlays/gpu")))["command"]
    gpu = engine_pod(command, 1)
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine_pod(command, 0)["nodeSelector"] == {"kubernetes.io/arch": "amd64"}


def test_the_cpu_overlay_places_cpu_engines(kubectl) -> None:
    command = operator_container(objects(kustomize(kubectl, REPO / "manifests/overlays/cpu")))["command"]
    cpu = engine_pod(command, 0)
    assert cpu["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert cpu["tolerations"] == [{"key": "kiln.dev/inference", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nodeSelector" not in engine_pod(command, 1)


# One test per value: each changes what it should, and only that.

def test_value_image(tmp_path) -> None:
    objs = rendered({"image": {"repository": "registry.example/kiln-operator", "tag": "9.9.9"}}, tmp_path)
    assert operator_container(objs)["image"] == "registry.example/kiln-operator:9.9.9"


def test_value_image_pull_policy(tmp_path) -> None:
    assert "imagePullPolicy" not in operator_container(objects(template()))
    assert operator_container(rendered({"image": {"pullPolicy": "Always"}}, tmp_path))["imagePullPolicy"] == "Always"


def test_value_image_pull_secrets(tmp_path) -> None:
    def pod(objs: dict) -> dict:
        return objs[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in pod(objects(template()))
    secrets = rendered({"image": {"pullSecrets": ["regcred", "mirror"]}}, tmp_path)
    assert pod(secrets)["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_value_operator_replicas(tmp_path) -> None:
    default = objects(template())
    assert default[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["replicas"] == 2
    assert ("PodDisruptionBudget", NAMESPACE, "kiln-operator") in default
    three = rendered({"operator": {"replicas": 3}}, tmp_path)
    assert three[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["replicas"] == 3
    one = rendered({"operator": {"replicas": 1}}, tmp_path)
    assert one[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["replicas"] == 1
    assert ("PodDisruptionBudget", NAMESPACE, "kiln-operator") not in one  # it would block every drain


def test_value_leader_election(tmp_path) -> None:
    default = objects(template())
    assert "--leader-elect" in operator_container(default)["command"]
    assert ("Role", NAMESPACE, "kiln-operator-leader") in default
    off = rendered({"operator": {"replicas": 1, "leaderElection": False}}, tmp_path)
    assert "--leader-elect" not in operator_container(off)["command"]
    assert ("Role", NAMESPACE, "kiln-operator-leader") not in off
    assert off[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["strategy"] == {"type": "Recreate"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"operator": {"replicas": 2, "leaderElection": False}}))
    refused = helm("template", "kiln", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(tmp_path / "bad.yaml"),
                   check=False)
    assert refused.returncode != 0 and "needs operator.leaderElection" in refused.stderr


def test_value_operator_resources(tmp_path) -> None:
    resources = {"requests": {"cpu": "250m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}}
    assert operator_container(rendered({"operator": {"resources": resources}}, tmp_path))["resources"] == resources


def test_value_watch_namespaces(tmp_path) -> None:
    default = objects(template())
    assert ("ClusterRoleBinding", "", "kiln-operator") in default
    assert not any(a.startswith("--namespace") for a in operator_container(default)["command"])
    objs = rendered({"watchNamespaces": ["team-a", "team-b"]}, tmp_path)
    assert [a for a in operator_container(objs)["command"] if a.startswith("--namespace")] == \
        ["--namespace=team-a", "--namespace=team-b"]
    assert ("ClusterRoleBinding", "", "kiln-operator") not in objs
    for ns in ("team-a", "team-b"):
        binding = objs[("RoleBinding", ns, "kiln-operator")]
        assert binding["roleRef"]["name"] == "kiln-operator"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kiln-operator", "namespace": NAMESPACE}]
    assert ("ClusterRoleBinding", "", "kiln-operator-cluster") in objs  # kopf's cluster-scoped reads


def test_value_rbac_create(tmp_path) -> None:
    rbac_kinds = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert {k[0] for k in objects(template())} >= rbac_kinds
    objs = rendered({"rbac": {"create": False}}, tmp_path)
    assert not {k[0] for k in objs} & rbac_kinds
    assert ("ServiceAccount", NAMESPACE, "kiln-operator") in objs and ("Deployment", NAMESPACE, "kiln-operator") in objs


def test_value_engine_image(tmp_path) -> None:
    assert "KILN_ENGINE_IMAGE" not in {e["name"] for e in operator_container(objects(template()))["env"]}
    env = operator_container(rendered({"engine": {"image": "registry.example/engine:1"}}, tmp_path))["env"]
    assert {"name": "KILN_ENGINE_IMAGE", "value": "registry.example/engine:1"} in env


def test_value_engine_placement(tmp_path) -> None:
    values = {"engine": {"gpu": {"nodeSelector": {"nvidia.com/gpu.present": "true"},
                                 "tolerations": ["nvidia.com/gpu:NoSchedule"]},
                         "cpu": {"nodeSelector": {"pool": "cpu"}, "tolerations": ["dedicated=ml:NoExecute"]}}}
    command = operator_container(rendered(values, tmp_path))["command"]
    gpu, cpu = engine_pod(command, 1), engine_pod(command, 0)
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert cpu["nodeSelector"] == {"pool": "cpu"}
    assert cpu["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}]


def operator_pod(objs: dict) -> dict:
    return objs[("Deployment", NAMESPACE, "kiln-operator")]["spec"]["template"]["spec"]


def test_value_operator_placement(tmp_path) -> None:
    default = operator_pod(objects(template()))
    assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName"} & default.keys()
    spread = default["topologySpreadConstraints"]  # replicas apart where there are nodes to spread over
    assert [(c["topologyKey"], c["whenUnsatisfiable"]) for c in spread] == [("kubernetes.io/hostname", "ScheduleAnyway")]
    values = {"nodeSelector": {"pool": "system"},
              "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
              "priorityClassName": "system-cluster-critical"}
    pod = operator_pod(rendered({"operator": values}, tmp_path))
    assert {key: pod[key] for key in values} == values


def test_value_prometheus_url_and_extra_args(tmp_path) -> None:
    command = operator_container(objects(template()))["command"]
    assert not [a for a in command if a.startswith("--prometheus-url")]
    objs = rendered({"prometheusUrl": "http://prometheus.observability.svc:9090",
                     "operator": {"extraArgs": ["--interval=60"]}}, tmp_path)
    command = operator_container(objs)["command"]
    assert "--prometheus-url=http://prometheus.observability.svc:9090" in command and command[-1] == "--interval=60"
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(command[2:])  # the operator takes them
    assert (args.prometheus_url, args.interval) == ("http://prometheus.observability.svc:9090", 60)


@pytest.mark.parametrize("flag", ["--liveness=http://:8081/healthz", "--metrics-port=9091", "--leader-elect",
                                  "--lease-namespace=other", "--namespace=team-c"])
def test_extra_args_that_the_chart_builds_on_are_refused(flag: str, tmp_path) -> None:
    """Given again the last wins: another liveness port crash-looped the pod, another metrics port
    left the Service and NetworkPolicy on 9090, another Lease namespace or a namespace of its own had
    no RBAC (403s)."""
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump({"operator": {"extraArgs": ["--interval=60", flag]}}))
    refused = helm("template", "kiln", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(tmp_path / "extra.yaml"),
                   check=False)
    assert refused.returncode != 0 and f"operator.extraArgs: {flag} is the chart's to set" in refused.stderr


@pytest.mark.parametrize("values, message", [
    ({"operator": {"nodeselector": {"pool": "x"}}}, "additional properties 'nodeselector' not allowed"),
    ({"engine": {"gpu": {"tolerations": ["nvidia.com/gpu=present: NoSchedule"]}}}, "does not match pattern"),
    ({"operator": {"replicas": 0}}, "/operator/replicas"),
    ({"prometheusUrl": "prometheus:9090"}, "/prometheusUrl"),
])
def test_values_the_chart_does_not_know_are_refused(tmp_path, values, message) -> None:
    """A typo or a malformed value fails the install with the value named, never rendered away."""
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    refused = helm("template", "kiln", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(tmp_path / "values.yaml"),
                   check=False)
    assert refused.returncode != 0 and message in refused.stderr, refused.stderr


def test_the_chart_refuses_a_cluster_older_than_its_floor() -> None:
    refused = helm("template", "kiln", str(CHART), "--kube-version", "1.29.4", check=False)
    assert refused.returncode != 0 and "requires kubeVersion: >=1.30.0-0" in refused.stderr


def test_the_crd_is_kept_when_a_release_or_a_gitops_application_goes() -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferenceservices.kiln.dev.yaml").read_text())
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep",
                                              "argocd.argoproj.io/sync-options": "Prune=false,Delete=false",
                                              "kustomize.toolkit.fluxcd.io/prune": "disabled"}


def test_namespaces_that_yaml_reads_as_numbers_or_booleans_render_as_strings():
    # Unquoted, namespace 2024 rendered as an integer and "on" as a boolean: objects the API server refuses.
    text = helm("template", "kiln", str(CHART), "-n", "2024", "--kube-version", KUBE_VERSION,
                "--set-string", "watchNamespaces={123,on}").stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    spaces = [d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]]
    spaces += [s["namespace"] for d in docs for s in d.get("subjects") or [] if "namespace" in s]
    assert set(spaces) == {"2024", "123", "on"}, spaces
    # So do release names (a label value the API server refuses as an integer or a boolean).
    for release in ("123", "on"):
        docs = [d for d in yaml.safe_load_all(helm("template", release, str(CHART), "--kube-version",
                                                   KUBE_VERSION).stdout) if d]
        values = [v for d in docs for v in (d["metadata"].get("labels") or {}).values()]
        assert values and all(isinstance(v, str) for v in values), values


@pytest.mark.parametrize("value", ["engine.gpu.tolerations={nvidia.com/gpu:NoScheduled}",
                                   "engine.gpu.nodeSelector.pool=yes please",
                                   "engine.cpu.nodeSelector.bad key!=x",
                                   "prometheusUrl=http:///api",  # no host: the operator's --prometheus-url check
                                   "prometheusUrl=http://[10.0.0.9]:9090",  # IPv4 in brackets: urlsplit refuses it
                                   "watchNamespaces={Team_A}"])  # no namespace name: --namespace's
def test_placement_values_the_operator_would_refuse_fail_the_install(value: str) -> None:
    # They passed the schema, and the operator exited 2 at start: a crash loop after a clean install.
    done = helm("template", "kiln", str(CHART), "--kube-version", KUBE_VERSION, "--set", value, check=False)
    assert done.returncode != 0 and "does not match pattern" in done.stderr, done.stderr
    assert helm("template", "kiln", str(CHART), "--kube-version", KUBE_VERSION,
                "--set", "engine.gpu.tolerations={nvidia.com/gpu:NoSchedule,dedicated=ml:NoExecute}",
                "--set", "prometheusUrl=http://[fd00::9]:9090/prom", "--set", "watchNamespaces={team-a,b2}").returncode == 0


def test_a_namespace_named_twice_fails_the_install() -> None:
    # Rendered twice: two RoleBindings of one name in one namespace, which the API server refuses mid-install.
    done = helm("template", "kiln", str(CHART), "--kube-version", KUBE_VERSION, "--set", "watchNamespaces={a,a}",
                check=False)
    assert done.returncode != 0 and "items at 0 and 1 are equal" in done.stderr, done.stderr
