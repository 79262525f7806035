"""What an engine container runs: the `kiln serve` command line an InferenceService's engine
settings make, and the volumes its model, draft model and LoRA adapters are read from. Pure
functions of the spec; render.py puts them into the Deployment."""
from __future__ import annotations

import json
from pathlib import PurePosixPath

from kubernetes.utils import parse_quantity

from .models import Adapter, InferenceServiceSpec, ModelSpec

PORT = 8000
MODEL_MOUNT = "/models"
DRAFT_MOUNT = "/draft-model"
ADAPTER_MOUNT = "/adapters"  # the i-th adapter's claim at /adapters/<i>
# The engine's own writable space, which render.py mounts beside the sources (/dev/shm only in a
# tensor-parallel pod, reserved in every one so that a spec's validity never hangs on it).
TMP_MOUNT = "/tmp"
SHM_MOUNT = "/dev/shm"
SCRATCH = {TMP_MOUNT: "the engine's own /tmp", SHM_MOUNT: "the engine's own /dev/shm"}


def model_location(model: ModelSpec | Adapter, volume: str = "model", mount_path: str = MODEL_MOUNT,
                   claims: dict[str, str] | None = None) -> tuple[str, list[dict], list[dict]]:
    """(--model argument, volumes, volume mounts) for a model source; a pvc:// claim is mounted at
    mount_path, unless `claims` (claim name -> where it is mounted already) has it."""
    scheme, rest = model.source.split("://", 1)
    if scheme == "builtin":
        return rest, [], []
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if claims and claim in claims:
            return str(PurePosixPath(claims[claim], path)), [], []
        source = {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        mount = {"name": volume, "mountPath": mount_path, "readOnly": True}
        return str(PurePosixPath(mount_path, path)), [source], [mount]
    # hostpath:///abs/path: shown inside the pod where it lies on the node.
    path = "/" + rest.lstrip("/")
    source = {"name": volume, "hostPath": {"path": path}}
    return path, [source], [{"name": volume, "mountPath": path, "readOnly": True}]


def model_volumes(spec: InferenceServiceSpec) -> tuple[str, str | None, list[str], list[dict], list[dict]]:
    """(--model argument, the draft model's or None, --lora-modules entries, volumes, volume mounts)
    of the target model, the draft model the engines speculate with and the LoRA adapters. A path
    two of them share is mounted once, and so is a claim: a pod whose volumes name one claim twice
    may never start (the kubelet waits on the second mount of a volume it mounted already).
    Raises ValueError when a source would be read through another volume (see _check_reads)."""
    model_arg, volumes, mounts = model_location(spec.model)
    reads = [("model.source", spec.model.source, model_arg)]
    owners = {"model": "model.source"}
    draft = spec.engine.draft_model
    draft_arg = None
    if draft is not None:
        draft_arg, draft_volumes, draft_mounts = model_location(draft, "draft-model", DRAFT_MOUNT,
                                                                _claims(volumes, mounts))
        _add_volumes(volumes, mounts, draft_volumes, draft_mounts)
        reads.append(("engine.speculative.model.source", draft.source, draft_arg))
        owners["draft-model"] = reads[-1][0]
    lora_modules = []
    for i, adapter in enumerate(spec.engine.adapters):
        path, adapter_volumes, adapter_mounts = model_location(adapter, f"adapter-{i}", f"{ADAPTER_MOUNT}/{i}",
                                                               _claims(volumes, mounts))
        _add_volumes(volumes, mounts, adapter_volumes, adapter_mounts)
        lora_modules.append(f"{adapter.name}={path}")
        reads.append((f"engine.adapters[{i}].source", adapter.source, path))
        owners[f"adapter-{i}"] = reads[-1][0]
    _check_reads(reads, volumes, mounts, owners)
    return model_arg, draft_arg, lora_modules, volumes, mounts


def _claims(volumes: list[dict], mounts: list[dict]) -> dict[str, str]:
    """Claim name -> where the pod mounts it, for the claims among `volumes`."""
    where = {m["name"]: m["mountPath"] for m in mounts}
    return {v["persistentVolumeClaim"]["claimName"]: where[v["name"]] for v in volumes if "persistentVolumeClaim" in v}


def _add_volumes(volumes: list[dict], mounts: list[dict], new_volumes: list[dict], new_mounts: list[dict]) -> None:
    """Add a source's volumes and mounts, but none at a path already mounted: there it is the same
    host folder (mounted once), or a clash that _check_reads refuses."""
    taken = {m["mountPath"] for m in mounts}
    kept = [m for m in new_mounts if m["mountPath"] not in taken]
    names = {m["name"] for m in kept}
    volumes += [v for v in new_volumes if v["name"] in names]
    mounts += kept


def _backing(source: str) -> tuple[str, str] | None:
    """What a source is read from: ("pvc", claim) or ("hostpath", node path); None for builtin://."""
    scheme, rest = source.split("://", 1)
    if scheme == "pvc":
        return "pvc", rest.partition("/")[0]
    return ("hostpath", str(PurePosixPath("/", rest))) if scheme == "hostpath" else None


def _check_reads(reads: list[tuple[str, str, str]], volumes: list[dict], mounts: list[dict],
                 owners: dict[str, str]) -> None:
    """Refuse a layout in which the engine would read a source (field, source, argument) through
    another volume: one mounted at the same path (Kubernetes refuses a path mounted twice, and
    _add_volumes keeps only the first) or below it (which hides that part of it). The wrong
    weights, or a Deployment the API server refuses, become a spec error the user sees instead."""
    backing = {v["name"]: ("pvc", v["persistentVolumeClaim"]["claimName"]) if "persistentVolumeClaim" in v
               else ("hostpath", str(PurePosixPath(v["hostPath"]["path"]))) for v in volumes}
    layout = [(m["mountPath"], backing[m["name"]], owners[m["name"]]) for m in mounts]
    layout += [(path, ("scratch", path), what) for path, what in SCRATCH.items()]
    for field, source, arg in reads:
        want = _backing(source)
        if want is None:
            continue
        # The mounts at the deepest path above the argument are the ones it is read through
        # (compared as paths: /tmp/ is /tmp).
        covering = [entry for entry in layout if PurePosixPath(arg).is_relative_to(entry[0])]
        deepest = max(len(PurePosixPath(path).parts) for path, _, _ in covering)
        for path, backed, what in covering:
            if backed != want and len(PurePosixPath(path).parts) == deepest:
                raise ValueError(
                    f"{field} {source} is read at {arg}, where {what} is mounted ({path}): the engine would "
                    f"not read {source}. A pvc:// claim is mounted at {MODEL_MOUNT}, {DRAFT_MOUNT} or "
                    f"{ADAPTER_MOUNT}/<i> and a hostpath:// folder at its own path; name a host folder "
                    f"apart from those and from {TMP_MOUNT} and {SHM_MOUNT}")


TP_KV_CACHE_MEMORY = "1Gi"
# Endpoints must drop the pod before SIGTERM starts the engine's drain; the grace period
# covers that pause plus finishing in-flight generations, which the engine's --drain-timeout
# must then allow for (its default, 30 s, cut them with 80 s of the grace period left).
PRESTOP_SLEEP_S = 10
GRACE_PERIOD_S = 120
DRAIN_TIMEOUT_S = GRACE_PERIOD_S - PRESTOP_SLEEP_S - 10  # 10 s to close connections and stop the engine


def option(flag: str, value: str) -> list[str]:
    """A flag and a value the user wrote: one word if the value starts with '-', which argparse
    took for a flag ("expected one argument", exit 2); two otherwise, as every other flag."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


def template_argument(template: str) -> str:
    """A chatTemplate as --chat-template takes it: the engine decodes an inline template's
    backslash escapes (as vLLM does), and the one written in YAML reaches it verbatim."""
    return template.replace("\\", "\\\\")


def engine_args(spec: InferenceServiceSpec, model_arg: str, draft_arg: str | None = None,
                lora_modules: list[str] | None = None) -> list[str]:
    engine = spec.engine
    args = ["kiln", "serve", "--model", model_arg, *option("--served-model-name", spec.model.served_name),
            "--port", str(PORT), "--dtype", engine.dtype,
            "--max-num-seqs", str(engine.maxNumSeqs), "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    if spec.resources.gpus > 0:
        # A pod given GPUs that cannot use them (an old driver, no NVIDIA runtime) must refuse to start,
        # not fall back to the CPU: "auto" would serve there, slowly, holding the GPUs.
        args += ["--device", "cuda"]
    # Unset, the engine sizes the pool (from GPU memory on a GPU), except under tensor parallelism,
    # whose ranks cannot profile a step alone: they keep 1Gi each.
    memory = engine.kvCache.memory or (TP_KV_CACHE_MEMORY if engine.tensorParallelSize > 1 else None)
    if memory is not None:
        args += ["--kv-cache-memory", str(int(parse_quantity(memory)))]
    if engine.maxModelLen is not None:
        args += ["--max-model-len", str(engine.maxModelLen)]
    if not engine.kvCache.prefixCaching:
        args.append("--no-prefix-caching")
    if engine.quantization != "none":
        args += ["--quantization", engine.quantization]
    if engine.kvCache.dtype != "auto":
        args += ["--kv-cache-dtype", engine.kvCache.dtype]
    if engine.tensorParallelSize > 1:
        args += ["--tensor-parallel-size", str(engine.tensorParallelSize)]
    speculative = engine.speculative
    if speculative is not None and (speculative.method == "ngram" or draft_arg is not None):
        config = {"method": "ngram"} if speculative.method == "ngram" else {"method": "draft_model", "model": draft_arg}
        config["num_speculative_tokens"] = speculative.numTokens
        if speculative.disableByBatchSize is not None:
            config["disable_by_batch_size"] = speculative.disableByBatchSize
        args += ["--speculative-config", json.dumps(config)]
    if engine.toolCallParser != "none":
        args += ["--tool-call-parser", engine.toolCallParser]
    if engine.chatTemplate is not None:
        args += option("--chat-template", template_argument(engine.chatTemplate))
    if lora_modules:
        args += ["--enable-lora", "--max-loras", str(engine.maxLoras), "--max-lora-rank", str(engine.maxLoraRank),
                 "--lora-modules", *lora_modules]
    return args
