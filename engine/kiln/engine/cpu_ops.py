"""The torch implementations of the model's fused residual-add + RMSNorm and RoPE (the "torch" and
"cpu" backends, kiln.engine.kernels.backend). They round as Hugging Face Llama does, as the
Triton kernels do (kiln.engine.kernels.norm_rope, whose *_ref functions are the references).
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for x [N, hidden]; without residual, x is the
    second value. The sum is written into x: x is a layer's fresh output that nothing else reads,
    and the sum is the next residual stream, so no buffer is allocated for it. Two [N, hidden]
    temporaries in float32 (squares, the output), where the unfused form makes four."""
    if residual is not None:
        x = x.add_(residual)
    if x.dtype == torch.float32:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        return torch.mul(x, rstd).mul_(weight), x
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return xf.mul_(rstd).to(x.dtype).mul_(weight), x  # rounded to x's dtype before the weight, as HF


def rope_prepare(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per step: each token's cos and sin [N, 1, D/2] from the table [P, D] (cos | sin)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def rope(qk: torch.Tensor, num_q_heads: int, prepared: tuple[torch.Tensor, torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of q and k side by side in qk [N, Hq + Hkv, D] -> (q, k), in qk's dtype."""
    cos, sin = prepared
    x1, x2 = qk.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out[:, :num_q_heads], out[:, num_q_heads:]
