"""SiLU-and-multiply of the MLP: one pass over the fused gate/up projection's output, where torch
runs two (silu, then mul), each reading and writing the [N, I] intermediate.

Rounding follows Hugging Face Llama's bf16 path: silu(gate) is computed in fp32 and rounded to the
activation dtype before it multiplies up; the product is rounded again.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns a program


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) -> silu(gate) * up [N, I] in gate_up's dtype."""
    _check(gate_up)
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, BLOCK))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                         BLOCK=BLOCK)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference (what the torch backend runs, without its in-place updates)."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul wants gate_up [N, 2I] with rows contiguous; got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
