"""Whole-system fixtures: a cluster with Kiln installed and an operator running.

Default: the local cluster (kiln.local: control plane + test pod runtime), started if it is
not running, with `kubectl apply -k manifests/` and `kiln operator` as a local process with
its ServiceAccount's token. With --kubeconfig (or $KUBECONFIG naming another cluster), the
tests run against that cluster instead: Kiln must already be installed and running there,
and the router is reached through `kubectl port-forward`.
"""
from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e_support import CHAT, MODEL, PROMPT, Target, local_operator
from kiln.local.cluster import free_port
from kiln.local.testing import KubectlError, OperatorProcess, eventually


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kubeconfig", default=None,
                     help="run e2e against this cluster (default: $KUBECONFIG, else the local cluster)")


def local_kubeconfig() -> Path:
    from kiln.local import cluster
    return cluster.Cluster(cluster.default_dir()).kubeconfig


@pytest.fixture(scope="session")
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    given = request.config.getoption("--kubeconfig") or os.environ.get("KUBECONFIG")
    if given and Path(given).resolve() != local_kubeconfig().resolve():
        yield Target(Path(given), None, "kubectl")
        return
    from kiln.local import build, cluster, demo

    if os.geteuid() != 0:
        pytest.fail("the local cluster needs root: it makes a bridge and network namespaces")
    c, _ = cluster.up(cluster.default_dir(), user=os.getpid())
    try:
        demo.install(c.kubeconfig)
        yield Target(c.kubeconfig, c, str(build.binary("kubectl")))
    finally:
        cluster.leave(c, os.getpid())


@pytest.fixture(scope="module")
def namespace(target: Target) -> Iterator[str]:
    name = f"kiln-e2e-{uuid.uuid4().hex[:6]}"
    target.kubectl("create", "namespace", name)
    # Pods are refused until the controller-manager has made the namespace's ServiceAccount.
    eventually(lambda: target.kubectl("get", "serviceaccount", "default", "-n", name), "the default ServiceAccount",
               timeout=120, ignore=(KubectlError,))
    try:
        yield name
    finally:
        target.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(target: Target, namespace: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess | None]:
    """On the local cluster, `kiln operator` for this namespace, opting its pods into the runtime
    (None elsewhere: the cluster's own operator does the work)."""
    if target.cluster is None:
        yield None
        return
    with local_operator(target, namespace, tmp_path_factory.mktemp("operator") / "operator.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def base_url(target: Target, namespace: str) -> Iterator[Callable[[str], str]]:
    """url(name): the InferenceService's router, as http://host:port (no /v1)."""
    forwards: list[subprocess.Popen] = []

    def url(name: str) -> str:
        if target.cluster is not None:  # no kube-proxy here: the router pod's IP on the bridge
            from kiln.local import demo
            found = eventually(lambda: demo.router_url(target.kubeconfig, name, namespace), "a ready router",
                               timeout=120, ignore=(KubectlError,))
            return found.removesuffix("/v1")
        port = free_port()
        forwards.append(subprocess.Popen([target.kubectl_bin, f"--kubeconfig={target.kubeconfig}", "port-forward",
                                          "-n", namespace, f"svc/{name}", f"{port}:8000"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        eventually(lambda: socket.create_connection(("127.0.0.1", port), timeout=2).close() or True,
                   "kubectl port-forward", timeout=120, ignore=(OSError,))
        return f"http://127.0.0.1:{port}"

    yield url
    for proc in forwards:
        proc.terminate()
        proc.wait()


@pytest.fixture(scope="session")
def reference() -> dict[str, str]:
    """The engine's own greedy answers, in-process, same dtype as examples/smollm2.yaml."""
    from kiln.engine import LLM, SamplingParams
    llm = LLM(MODEL, dtype="float32", device="cpu", kv_cache_memory=256 << 20, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    return {"completion": llm.generate(PROMPT, params)[0].text, "chat": llm.chat(CHAT, params)[0].text}
