"""Launch configs tuned on a GPU by bench/tune_kernels.py, one JSON file per GPU model.

tuned/<slug>.json (slug: the lowercased device name, non-alphanumerics as '-', e.g. nvidia-h200):

    {"gpu": "NVIDIA H200", "machine": {...},
     "configs": {"<kernel>": {"<shape key>": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}}}

An entry overrides some of a launcher's tile constexprs and may add num_warps / num_stages (and
for quant_gemm SPLIT_K); each launcher defines its keys. A GPU without a file, a key without an
entry, CPU tensors and the interpreter keep the launchers' defaults, so tests see one config.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch

FOLDER = Path(__file__).resolve().parent / "tuned"

_overrides: dict[tuple[str, str], dict[str, Any] | None] = {}


def slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


@functools.cache
def _table(device_index: int) -> dict[str, dict[str, dict[str, Any]]]:
    path = FOLDER / f"{slug(torch.cuda.get_device_name(device_index))}.json"
    return json.loads(path.read_text())["configs"] if path.exists() else {}


def lookup(kernel: str, key: str, device: torch.device) -> dict[str, Any] | None:
    """The tuned entry for (kernel, key) on this device's GPU model, or None for the defaults."""
    if (kernel, key) in _overrides:
        return _overrides[(kernel, key)]
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _table(index).get(kernel, {}).get(key)


@contextlib.contextmanager
def override(kernel: str, key: str, config: dict[str, Any] | None) -> Iterator[None]:
    """Use `config` (None: no entry, the launcher's defaults) for (kernel, key) on any device, the
    interpreter included: how the tuner times candidates and tests run non-default configs."""
    previous = _overrides.get((kernel, key), _overrides)  # _overrides: a sentinel for "none set"
    _overrides[(kernel, key)] = config
    try:
        yield
    finally:
        if previous is _overrides:
            del _overrides[(kernel, key)]
        else:
            _overrides[(kernel, key)] = previous
