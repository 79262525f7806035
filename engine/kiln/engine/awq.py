"""Activation-aware scaling (AWQ, Lin et al. 2023), the scale search only (no weight clipping
search): per input channel s = mean|x|^alpha, alpha searched on a grid to minimise the layer's
output error after quantizing W diag(s) with the method's own rounding, with inputs x / s.
Made for int4, and used for int8 and fp8 too: salient input channels lose less to any rounding.

Inputs are captured in one float forward of the unquantized model over the calibration text
shipped with the package (data/calibration.txt), so every layer sees its float inputs.
"""
from __future__ import annotations

from importlib import resources

import torch
from torch import nn

from kiln.engine.context import prefill_context, reset_context, set_context
from kiln.engine.quantization import fake_quantize, quantizable_linears

ALPHA_GRID = tuple(i / 10 for i in range(11))  # 0 = plain RTN, so the search never does worse on its data
CALIBRATION_TOKENS = 512
# The preceding RMSNorm whose weight can absorb 1/s; other inputs keep s as a multiplier.
NORM_BEFORE = {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"}


# data/calibration.txt: Jane Austen, Pride and Prejudice (1813), the opening of chapter 1 -- public
# domain (Project Gutenberg eBook #1342). Prose only; nothing is downloaded at run time.
def calibration_text() -> str:
    return resources.files("kiln.engine").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def calibration_token_ids(tokenizer, max_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    if tokenizer is None:
        raise ValueError("activation-aware quantization needs a tokenizer or calibration token ids for its calibration pass")
    return tokenizer.encode(calibration_text())[:max_tokens]


def max_positions(model: nn.Module) -> int | None:
    """Positions the model's rotary table covers (its max_model_len), if it has one."""
    return next((m.cos_sin.shape[0] for m in model.modules() if hasattr(m, "cos_sin")), None)


def calibration_window(model: nn.Module, n_tokens: int = CALIBRATION_TOKENS) -> int:
    """Tokens per calibration sequence: the text is cut into sequences the model's positions cover,
    so a model loaded with a shorter max_model_len calibrates (and quantizes) differently."""
    return min(n_tokens, max_positions(model) or n_tokens)


@torch.no_grad()
def capture_inputs(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Each quantizable Linear's input rows [T, K] (float32) for one prefill of token_ids: one
    sequence, or several back to back where the model was loaded with a max_model_len shorter
    than the calibration text (every replica of a revision shares it, so they agree)."""
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in quantizable_linears(model):
        def hook(_module, args, name=name):
            captured[name] = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        hooks.append(module.register_forward_pre_hook(hook))
    device = next(model.parameters()).device
    window = calibration_window(model, len(token_ids))
    lengths = [len(token_ids[i:i + window]) for i in range(0, len(token_ids), window)]
    set_context(prefill_context(lengths, device))
    try:
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        model(ids, torch.cat([torch.arange(n, device=device) for n in lengths]))
    finally:
        reset_context()
        for h in hooks:
            h.remove()
    return captured


@torch.no_grad()
def search_scale(w: torch.Tensor, x: torch.Tensor, method: str, group_size: int | None = None,
                 grid: tuple[float, ...] = ALPHA_GRID) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scale s for W [N, K] on inputs x [T, K]: (s, alpha, output MSE)."""
    w, x = w.float(), x.float()
    ref = x @ w.T
    x_mean = x.abs().mean(0).clamp(min=1e-6)
    best: tuple[torch.Tensor, float, float] | None = None
    for alpha in grid:
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (AWQ's normalisation)
        err = ((x / s) @ fake_quantize(w * s, method, group_size).T - ref).pow(2).mean().item()
        if best is None or err < best[2]:
            best = (s, alpha, err)
    assert best is not None
    return best


def norm_before(linear: str) -> str | None:
    """The norm right before a linear, into which AWQ folds 1/s; None: s stays on its activation."""
    for suffix, norm_name in NORM_BEFORE.items():
        if linear.endswith(suffix):
            return linear[: -len(suffix)] + norm_name
    return None


def scale_tensor(linear: str) -> str:
    """Where a variant keeps a linear's s: the folded_scale of the norm before it, else its own act_scale."""
    norm = norm_before(linear)
    return f"{norm}.folded_scale" if norm is not None else f"{linear}.act_scale"


def awq_scales(model: nn.Module, token_ids: list[int], method: str, group_size: int | None = None
               ) -> dict[str, tuple[torch.Tensor, str | None]]:
    """Linear name -> (s, the norm to fold 1/s into, or None to keep s on the activation)."""
    inputs = capture_inputs(model, token_ids)
    result = {}
    for name, module in quantizable_linears(model):
        x = inputs.pop(name)
        s, _, _ = search_scale(module.weight, x, method, group_size)
        result[name] = (s, norm_before(name))
    return result
