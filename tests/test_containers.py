"""Image names from one place, and the test runtime's container mode as a command line
(kiln.local.containers.podman_argv: a pure function of the pod). Building and running the images
is e2e/test_images.py (whose name this file must not share: one pytest session runs both)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes
import pytest
import yaml

from kiln.local import containers
from kiln.operator import images, render

REPO = Path(__file__).resolve().parents[1]


def test_every_image_reference_carries_the_package_version():
    version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('kiln'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    pyproject = next(line for line in (REPO / "pyproject.toml").read_text().splitlines() if line.startswith("version"))
    assert f'"{version}"' in pyproject
    assert images.image("engine") == f"ghcr.io/kiln/engine:{version}" == render.DEFAULT_ENGINE_IMAGE
    deployment = next(d for d in yaml.safe_load_all((REPO / "manifests/base/operator.yaml").read_text())
                      if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == images.image("operator")
    # No second engine reference to drift: the operator defaults to its own release's engine.
    assert "KILN_ENGINE_IMAGE" not in {e["name"] for e in container.get("env", [])}
    with pytest.raises(ValueError, match="unknown image"):
        images.image("router")


def pod(container: dict, spec: dict | None = None) -> object:
    """A V1Pod as the runtime reads it from the API (deserialized by the kubernetes client)."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "e-1", "namespace": "ns", "uid": "0123456789abcdef",
                         "annotations": {containers.MODE_ANNOTATION: "container"}},
            "spec": {"containers": [{"name": "engine", "image": "ghcr.io/kiln/engine:0.1.0", **container},
                                    ], **(spec or {})}}
    return kubernetes.client.ApiClient().deserialize(json.dumps(body), "V1Pod", "application/json")


def argv(p: object, image_user: str = "10001:10001", controllers: frozenset = frozenset({"memory", "cpu"}),
         kubeconfig: Path | None = None) -> list[str]:
    return containers.podman_argv(p, {"A": "1"}, "kiln0-p01234567", image_user, Path("/vol"), set(controllers),
                                  kubeconfig, "/state")


def option(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_an_engine_pod_becomes_podman_run_with_its_command_security_and_limits():
    """What the operator renders for an engine pod, as podman flags."""
    p = pod({"command": ["kiln", "serve", "--model", "smollm2-135m"], "args": ["--port", "8000"],
             "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
             "securityContext": render.HARDENED,
             "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"},
                              {"name": "model", "mountPath": "/m", "readOnly": True}]},
            {"securityContext": render.POD_SECURITY,
             "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                         {"name": "model", "hostPath": {"path": "/data/m"}}]})
    a = argv(p, kubeconfig=Path("/state/pods/u/token/kubeconfig"))
    assert a[:3] == ["--runtime", "runc", "run"]
    assert option(a, "--network") == ["ns:/run/netns/kiln0-p01234567"]
    assert option(a, "--label") == [f"{containers.CLUSTER_LABEL}=/state"]  # what `kiln local down` removes
    assert option(a, "--user") == [f"{render.RUN_AS}:{render.RUN_AS}"]
    assert option(a, "--group-add") == [str(render.RUN_AS)]
    assert "--read-only" in a and "--read-only-tmpfs=false" in a
    assert option(a, "--security-opt") == ["no-new-privileges"] and "--cap-drop=ALL" in a
    assert option(a, "--memory") == [str(2 << 30)] and option(a, "--cpu-shares") == ["512"]
    assert option(a, "--cpus") == []  # no CPU limit asked for
    assert option(a, "--volume") == ["/vol/tmp:/tmp:rw", "/data/m:/m:ro",
                                     f"/state/pods/u/token:{containers.TOKEN_DIR}:ro"]
    assert option(a, "--mount") == ["type=tmpfs,destination=/dev/shm"]
    # a value comes from podman's environment, not its command line (`ps` shows that to anyone)
    assert option(a, "--env") == ["A", f"KUBECONFIG={containers.TOKEN_DIR}/kubeconfig"]
    collides = containers.podman_argv(p, {"A": "1", "HOME": "/tmp"}, "n", "10001", Path("/vol"), set(), None,
                                      podman_env={"HOME": "/root", "PATH": "/bin"})
    assert option(collides, "--env") == ["A", "HOME=/tmp"]  # podman keeps its own HOME; the pod's is given
    # command replaces the ENTRYPOINT, args follow the image name
    assert json.loads(option(a, "--entrypoint")[0]) == ["kiln", "serve", "--model", "smollm2-135m"]
    assert a[-3:] == ["ghcr.io/kiln/engine:0.1.0", "--port", "8000"]


def test_an_engine_told_to_use_cuda_runs_on_the_cpu_here():
    """The operator gives a GPU pod `--device cuda`; this runtime's GPU nodes have no GPUs."""
    p = pod({"command": ["kiln", "serve", "--device", "cuda", "--model", "cuda"], "args": ["--device", "cuda:1"]})
    a = argv(p)
    assert json.loads(option(a, "--entrypoint")[0]) == ["kiln", "serve", "--device", "cpu", "--model", "cuda"]
    assert a[-2:] == ["--device", "cpu"]
    assert containers.without_gpus(["kiln", "serve", "--device", "cpu"]) == ["kiln", "serve", "--device", "cpu"]


def test_the_injected_service_account_volume_becomes_the_kubeconfig_mount():
    """ServiceAccount admission adds a projected token volume to a pod that automounts its token."""
    p = pod({"volumeMounts": [{"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                               "readOnly": True}]},
            {"volumes": [{"name": "kube-api-access-x", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}]})
    a = argv(p, kubeconfig=Path("/state/pods/u/token/kubeconfig"))
    assert option(a, "--volume") == [f"/state/pods/u/token:{containers.TOKEN_DIR}:ro"]


def test_limits_need_the_hosts_cgroup_controllers_and_no_command_keeps_the_entrypoint():
    p = pod({"args": ["--help"], "resources": {"limits": {"memory": "1Gi", "cpu": "2"}}})
    a = argv(p, controllers=frozenset())
    assert "--memory" not in a and "--cpus" not in a and "--entrypoint" not in a
    assert option(argv(p), "--cpus") == ["2"]
    assert a[-2:] == ["ghcr.io/kiln/engine:0.1.0", "--help"]


@pytest.mark.parametrize("container,spec,image_user,reason", [
    ({}, {"securityContext": {"runAsNonRoot": True}}, "0", "would run as root"),
    ({}, {"securityContext": {"runAsNonRoot": True}}, "", "not numeric"),
    ({"securityContext": {"runAsNonRoot": True, "runAsUser": 0}}, {}, "10001", "would run as root"),
    ({"securityContext": {"privileged": True}}, {}, "10001", "privileged"),
    ({"volumeMounts": [{"name": "data", "mountPath": "/d"}]},
     {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}, "10001", "only emptyDir and hostPath"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/d"}]}, {}, "10001", "names no volume"),
])
def test_what_container_mode_refuses(container, spec, image_user, reason):
    with pytest.raises(ValueError, match=reason):
        argv(pod(container, spec), image_user=image_user)


def test_run_as_non_root_is_satisfied_by_the_images_user():
    a = argv(pod({}, {"securityContext": {"runAsNonRoot": True}}), image_user="10001:10001")
    assert "--user" not in a  # the image's USER applies, as it does under a kubelet


def test_only_annotated_pods_run_from_their_image():
    assert containers.wants_container(pod({}))
    plain = pod({})
    plain.metadata.annotations = {}
    assert not containers.wants_container(plain)
