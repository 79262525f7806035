"""Quantized variants, computed once per (weights, method) and cached on disk.

A variant is the state dict `Quantizer.create_quantized_state_dict()` returns. Computing it
costs a calibration pass (activation-aware scaling, for all but int4-rtn) and a pass over every
weight, so the first load writes it to the variant cache and every later load -- a restart, or another replica
sharing the directory -- reads it back instead.

The cache directory holds one pair of files per variant, named by its key
`<first 32 hex digits of the weights' sha256>-<method>-<dtype>[-w<window>][-c<calibration>]-v<FORMAT_VERSION>`:
  KEY.safetensors  the state dict
  KEY.json         manifest: format version, method, dtype, the weights' sha256, and the sha256
                   of KEY.safetensors
An activation-aware calibration also depends on the model's config (rope, norms, heads) and on
the calibration text's token ids (the tokenizer), neither in the weight files: their sha256 is
the `-c` part (16 hex digits) and in the manifest, so an edited config.json calibrates anew.
The weights' sha256 is that of the GGUF file, or, for a Hugging Face folder, of the lines
`<sha256>  <name>` of its weight files (weight_files) in name order (sha256sum's output). The dtype is in
the key because the weights are quantized as loaded (bfloat16 by default); the calibration window
(kiln.engine.awq.calibration_window) is, where a max_model_len shorter than the calibration text
cuts it into several sequences, because that calibrates differently, and it is in every manifest. Each file is written to
a temporary name in the same directory and moved into place with os.replace, the manifest last,
so a reader sees whole files or none. A variant whose bytes do not match its manifest (corrupt,
truncated, or swapped by a concurrent writer) is logged as a warning, recomputed and rewritten.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from kiln.engine import startup
from kiln.engine.awq import CALIBRATION_TOKENS, calibration_token_ids, calibration_window
from kiln.engine.config import DTYPES, Config, ModelLoadError
from kiln.engine.quantization import ACTIVATION_AWARE, Quantizer, check_method

log = logging.getLogger("kiln.engine")

FORMAT_VERSION = 3  # 2: int8 and fp8 activation-aware too; 3: AWQ's folded norm scales kept (LoRA needs them)
# Variants computed (not read from a cache) by this process, per method: what tests and
# operators look at to tell a calibration from a cache hit.
COMPUTED: collections.Counter[str] = collections.Counter()
_CHUNK = 1 << 20
_file_hashes: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, this process


def default_cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln") / "variants"


def cache_dir(config: Config) -> Path | None:
    """config.quantization_cache resolved: None when caching is off, and for random weights
    (load_format "dummy"): the cache is keyed by the weight files, which they did not come from."""
    if config.quantization_cache == "off" or config.load_format == "dummy":
        return None
    return Path(config.quantization_cache).expanduser() if config.quantization_cache else default_cache_dir()


def file_sha256(path: Path) -> str:
    """sha256 of one file, read in chunks; remembered per (path, size, mtime) for this process."""
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _file_hashes:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        _file_hashes[memo] = digest.hexdigest()
    return _file_hashes[memo]


def weight_files(folder: Path) -> list[Path]:
    """A Hugging Face folder's weight files: those its model.safetensors.index.json names, else
    every *.safetensors (Mistral's repositories keep a consolidated.safetensors of the same
    weights, under other names, beside the shards)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    # A shard is a file of the folder by its bare name: "../other/x.safetensors" or an absolute
    # path read another model's weights, quietly.
    missing = [n for n in names if not isinstance(n, str) or Path(n).name != n or not (folder / n).is_file()]
    if missing:
        raise ModelLoadError(f"{index} names shards that are not in the folder: {missing[:5]}")
    return [folder / n for n in names]


def weights_sha256(path: Path) -> str:
    """The identity of a model's weights: the GGUF file's sha256, or a folder's weight files."""
    if path.is_file():
        return file_sha256(path)
    lines = "".join(f"{file_sha256(f)}  {f.name}\n" for f in weight_files(path))
    return hashlib.sha256(lines.encode()).hexdigest()


def model_dtype_name(model: nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return next(name for name, d in DTYPES.items() if d == dtype)


def variant_key(weights_sha: str, method: str, dtype_name: str, window: int | None = None,
                calibrated: str | None = None) -> str:
    """window: the calibration window where it is shorter than the calibration text, else None;
    calibrated: calibration_sha256, for an activation-aware method."""
    cut = f"-w{window}" if window is not None else ""
    inputs = f"-c{calibrated[:16]}" if calibrated is not None else ""
    return f"{weights_sha[:32]}-{method}-{dtype_name}{cut}{inputs}-v{FORMAT_VERSION}"


def calibration_sha256(model: nn.Module, tokenizer: Any) -> str:
    """What an activation-aware calibration reads besides the weights: the model's config and
    the calibration text's token ids."""
    config = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
    return hashlib.sha256(f"{config}\n{calibration_token_ids(tokenizer)}".encode()).hexdigest()


def calibration(model: nn.Module, method: str) -> tuple[int | None, int | None]:
    """(the calibration window of method on model, None for a method without calibration;
    the window again where it cuts the calibration text short, for the key, else None)."""
    if method not in ACTIVATION_AWARE:
        return None, None
    window = calibration_window(model)
    return window, (window if window < CALIBRATION_TOKENS else None)


def atomic_write(path: Path, data: bytes) -> None:
    """Write data to path so that readers see the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes it 0600: a pod running as another user could not read a variant
            # written on the host (hostPath) or by an init container. Readable as open() would make it.
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_cached(directory: Path, key: str, expected: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The cached state dict, or None when absent or unusable (with a warning when unusable)."""
    manifest_path, tensors_path = directory / f"{key}.json", directory / f"{key}.safetensors"
    try:
        if not manifest_path.exists():  # PermissionError: a directory this user may not search
            return None
        manifest = json.loads(manifest_path.read_text())
        data = tensors_path.read_bytes()  # read once: hashed and parsed from the same bytes
    except (OSError, ValueError) as e:
        log.warning("cached variant %s is unreadable (%s); recomputing it", manifest_path, e)
        return None
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in expected.items()):
        log.warning("cached variant %s does not describe this model and method; recomputing it", manifest_path)
        return None
    if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        log.warning("cached variant %s does not match the checksum in %s (corrupt or truncated); recomputing it",
                    tensors_path, manifest_path.name)
        return None
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # SafetensorError on a header that is wrong despite the checksum
        log.warning("cached variant %s cannot be parsed (%s); recomputing it", tensors_path, e)
        return None


def write_cached(directory: Path, key: str, state: dict[str, torch.Tensor], manifest: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()})
    tensors_path = directory / f"{key}.safetensors"
    atomic_write(tensors_path, data)
    manifest = {**manifest, "file": tensors_path.name, "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write(directory / f"{key}.json", json.dumps(manifest, indent=2).encode())
    return tensors_path


def quantized_state_dict(model: nn.Module, method: str, tokenizer: Any, weights_path: Path,
                         directory: Path | None) -> dict[str, torch.Tensor]:
    """The variant of model (its float weights, loaded from weights_path) for method: read from
    the cache in directory when it is there and intact, else computed (and cached)."""
    check_method(method)
    dtype_name = model_dtype_name(model)
    weights_sha = weights_sha256(weights_path)
    window, cut = calibration(model, method)
    calibrated = calibration_sha256(model, tokenizer) if method in ACTIVATION_AWARE else None
    key = variant_key(weights_sha, method, dtype_name, cut, calibrated)
    # A manifest without the window was written before it was recorded: recomputed once, since it
    # may come from a shorter max_model_len.
    expected = {"format_version": FORMAT_VERSION, "method": method, "dtype": dtype_name,
                "weights_sha256": weights_sha, "calibration_window": window, "calibration_sha256": calibrated}
    if directory is not None:
        state = read_cached(directory, key, expected)
        if state is not None:
            log.info("loaded cached %s variant from %s", method, directory / f"{key}.safetensors")
            return state
    start = time.perf_counter()
    state = Quantizer(model, method, tokenizer=tokenizer).create_quantized_state_dict()
    if not state:
        raise ValueError(f"{weights_path.name}: no float projections to quantize (already quantized?)")
    COMPUTED[method] += 1
    seconds = time.perf_counter() - start
    where = "not cached"
    if directory is not None:
        try:
            where = f"cached at {write_cached(directory, key, state, expected)}"
        except OSError as e:  # a read-only or full disk costs the next replica a recompute, nothing more
            log.warning("cannot write the %s variant to %s: %s", method, directory, e)
    log.info("quantized %s with %s in %.1f s (%s)", weights_path.name, method, seconds, where)
    return state


@startup.phase("quantize")
def apply_quantization(model: nn.Module, config: Config, tokenizer: Any, weights_path: Path) -> None:
    """Swap model's Linears for config.quantization's QuantLinears ("none": leave it as is)."""
    if config.quantization == "none":
        return
    state = quantized_state_dict(model, config.quantization, tokenizer, weights_path, cache_dir(config))
    Quantizer(model, config.quantization).convert_for_runtime(state)
