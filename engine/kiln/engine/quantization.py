"""Weight-only quantization at load time, gpt-fast style: `Quantizer.create_quantized_state_dict()`
turns the model's float Linear weights into quantized tensors (one canonical, device-independent
format per method), and `Quantizer.convert_for_runtime()` swaps each Linear for a QuantLinear that
packs them for the device's matmul. Embeddings and the lm_head (tied or not) stay unquantized.

Formats (W ~ dequantize(...), row n = output channel, column k = input channel):
  int8      symmetric per output channel: W = q * s[n], q int8 in -127..127, s = absmax / 127.
            Group-wise scales s[n, k // G] are accepted too (GGUF's Q8_0, kiln.engine.gguf_quant).
  int4-rtn  group-wise along K (group 128, or the largest power of two >= 32 dividing K),
            asymmetric, round to nearest: W = (q - z) * s per (row, group), q and z in 0..15.
            Stored as quant_gemm's W4A16 layout (two codes a byte, even k in the low nibble).
            The int4 modules also take z = 8 implicitly (zeros=None, GGUF's Q4_0) or a float
            offset instead of z: W = q * s + m (mins, GGUF's Q4_1).
  int4      the int4-rtn format after AWQ-style activation-aware scaling (kiln.engine.awq).
  fp8       float8_e4m3fn with a per-output-channel scale: W = e4m3 * s[n], s = absmax / 448.
int8, int4 and fp8 all quantize W diag(s) after the activation-aware search (ACTIVATION_AWARE): on
SmolLM2 it halves int8's KL and cuts fp8's perplexity cost from 3.4% to 0.5% (README's table).

Runtime matmuls:
  CPU   int8: torch._weight_int8pack_mm for bf16/fp16 activations, and for float32 ones only up to
        FP32_PACKED_MAX_ROWS rows (its float32 path is a slow reference loop: 137 ms vs 10 ms for
        dequantize-then-matmul at 174x576x3072); else dequantize then matmul.
        int4: torch._weight_int4pack_mm_for_cpu for bf16/fp16 activations with N % 16 == 0 (tinygemm's
        packed layout, which cannot cheaply be dequantized back); float32 models (same slow reference
        path) and other shapes keep quant_gemm's layout and dequantize then matmul.
        fp8: cast to the activation dtype, matmul, scale the output columns.
  CUDA  int8/int4: the Triton W8A16/W4A16 kernels of kiln.engine.kernels.quant_gemm; fp8:
        torch._scaled_mm (sm89+: activations quantized per row to e4m3 on the fly), else dequantize.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.config import QUANTIZATION_METHODS
INT4_GROUP_SIZES = (128, 64, 32)  # shared by the Triton kernel (32..128) and the CPU int4pack op (32..256)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP32_PACKED_MAX_ROWS = 4
ACTIVATION_AWARE = ("int8", "int4", "fp8")  # int4-rtn is the plain baseline the search is judged against
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def check_method(method: str) -> str:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    return method


# ---------------------------------------------------------------------------------------------
# quantize / dequantize (float32 math; the torch references the tests check against)
# ---------------------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales float32 [N])."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-channel scales [N], or group-wise scales [N, K // G]."""
    if scales.dim() == 1:
        return q.float() * scales.float()[:, None]
    n, groups = scales.shape
    return q.float().view(n, groups, -1).mul_(scales.float()[..., None]).view(n, -1)  # in place: one float copy


def int4_group_size(in_features: int) -> int:
    """128, else the largest power-of-two group >= 32 that divides in_features."""
    for g in INT4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(f"int4 needs in_features divisible by a group size in {INT4_GROUP_SIZES}; "
                     f"got in_features={in_features}")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> uint8 [N, K // 2], even k in the low nibble (quant_gemm's layout)."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1)


def quantize_int4(w: torch.Tensor, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed uint8 [N, K//2], scales float32 [N, K//G], zeros uint8 [N, K//G]);
    asymmetric: the group's range [min(lo, 0), max(hi, 0)] maps onto the codes 0..15."""
    if w.dim() != 2:
        raise ValueError(f"int4 wants a matrix [N, K]; got shape {tuple(w.shape)}")
    g = group_size or int4_group_size(w.shape[1])
    if g not in INT4_GROUP_SIZES or w.shape[1] % g:
        raise ValueError(f"int4 group size {g} must be one of {INT4_GROUP_SIZES} and divide K={w.shape[1]}")
    groups = w.float().reshape(w.shape[0], -1, g)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    codes = torch.round(groups / scales[..., None] + zeros[..., None]).clamp(0, 15).reshape(w.shape)
    return pack_int4(codes), scales, zeros.to(torch.uint8)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    mins: torch.Tensor | None = None) -> torch.Tensor:
    """(q - z) * s with integer zeros z [N, K // G] (None: z = 8), or q * s + m with float mins m."""
    n, groups = scales.shape
    q = unpack_int4(packed).float().reshape(n, groups, -1)
    s = scales.float()[..., None]
    # In place, so a call makes one float copy: CPU float32 matmuls dequantize on every call.
    if mins is not None:
        return q.mul_(s).add_(mins.float()[..., None]).reshape(n, -1)
    return q.sub_(8.0 if zeros is None else zeros.float()[..., None]).mul_(s).reshape(n, -1)


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """dequantize(quantize(w)) without packing: what AWQ's search scores."""
    groups = w.float().reshape(w.shape[0], -1, group_size)
    lo, hi = groups.amin(-1, keepdim=True).clamp(max=0), groups.amax(-1, keepdim=True).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    zeros = torch.round(-lo / scales)
    return ((torch.round(groups / scales + zeros).clamp(0, 15) - zeros) * scales).reshape(w.shape)


def fake_quantize(w: torch.Tensor, method: str, group_size: int | None = None) -> torch.Tensor:
    """dequantize(quantize(w)) in float32 for any method: what the activation-aware search scores."""
    if method == "int8":
        return dequantize_int8(*quantize_int8(w))
    if method == "fp8":
        return dequantize_fp8(*quantize_fp8(w))
    return fake_quantize_int4(w, group_size or int4_group_size(w.shape[1]))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scales float32 [N])."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (wf / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


# ---------------------------------------------------------------------------------------------
# runtime modules
# ---------------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """y = (x * act_scale) W^T + b with W held quantized. act_scale (per input channel, optional)
    is AWQ's 1/s where it could not be folded into a preceding norm."""

    method = "none"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 act_scale: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.act_scale = None if act_scale is None else nn.Parameter(act_scale.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_scale is not None:
            x = x * self.act_scale
        shape = x.shape
        y = self._mm(x.reshape(-1, self.in_features)).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


class Int8Linear(QuantLinear):
    """Scales per output channel [N], or group-wise [N, K // G]. On the CPU the group-wise form
    dequantizes (in float32, then the model dtype) and multiplies: torch's int8 ops take per-channel
    scales only, and per-group matmuls (bmm over the groups) measured slower than that.
    scale_dtype: the dtype scales are kept in (default: the model's); GGUF keeps its exact float16."""

    method = "int8"

    def __init__(self, qweight, scales, bias=None, act_scale=None, dtype=torch.float32,
                 kernel: str | None = None, *, scale_dtype: torch.dtype | None = None) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias, act_scale, dtype)
        if qweight.data_ptr() % 64:  # read in place from a safetensors file, it may sit 8 bytes off
            # a 16-byte line, and torch's int8 kernel with bf16 activations crashed the process on it
            qweight = qweight.clone()
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(scale_dtype or dtype).contiguous())
        self.group_size = qweight.shape[1] // scales.shape[1] if scales.dim() == 2 else None
        if kernel is not None:
            self.kernel = kernel
        elif qweight.is_cuda:
            self.kernel = "triton_w8a16"
        else:  # torch's int8 kernel with bf16 activations returns garbage or crashes unless K % 16 == 0
            self.kernel = "dequantize" if self.group_size or qweight.shape[1] % 16 else "weight_int8pack_mm"

    def _mm(self, x):
        x = x.to(self.dtype)
        if self.kernel == "triton_w8a16":
            from kiln.engine.kernels.quant_gemm import w8a16_gemm
            return w8a16_gemm(x, self.qweight, self.scales)
        if self.kernel == "dequantize":
            return F.linear(x, self.dequantized_weight().to(x.dtype))
        if x.dtype != torch.float32 or x.shape[0] <= FP32_PACKED_MAX_ROWS:
            return torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales.to(x.dtype))
        # per-row scale factors out of the K sum
        return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)

    def dequantized_weight(self):
        return dequantize_int8(self.qweight, self.scales)


class Int4Linear(QuantLinear):
    """Offsets per (row, group): integer zeros (W = (q - z) * s), zeros=None (z = 8), or float
    mins (W = q * s + m). CPU: tinygemm's int4pack layout, dequantized as (q - 8) * s + zero_f with
    zero_f = (8 - z) * s or m + 8 * s, so the canonical forms carry over (exactly up to the rounding
    of zero_f in the model dtype). CUDA: quant_gemm's layout as is. scale_dtype: as for Int8Linear."""

    method = "int4"

    def __init__(self, packed, scales, zeros, bias=None, act_scale=None, dtype=torch.float32,
                 kernel: str | None = None, *, mins: torch.Tensor | None = None,
                 scale_dtype: torch.dtype | None = None) -> None:
        n, k = packed.shape[0], packed.shape[1] * 2
        super().__init__(k, n, bias, act_scale, dtype)
        self.group_size = k // scales.shape[1]
        if kernel is not None:
            self.kernel = kernel  # tests force the CPU packed op for float32
        elif packed.is_cuda:
            self.kernel = "triton_w4a16"
        elif n % 16 == 0 and self.group_size in (32, 64, 128, 256) and dtype in (torch.bfloat16, torch.float16):
            self.kernel = "weight_int4pack_mm_for_cpu"
        else:
            self.kernel = "dequantize"
        if self.kernel == "weight_int4pack_mm_for_cpu":
            codes = unpack_int4(packed).to(torch.int32)
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(codes, 2))
            s = scales.float()
            if mins is not None:
                zero_f = mins.float() + 8 * s
            else:
                zero_f = (8 - zeros.float()) * s if zeros is not None else torch.zeros_like(s)
            self.register_buffer("scales_and_zeros",
                                 torch.stack([s, zero_f], -1).transpose(0, 1).contiguous().to(dtype))
        else:
            self.register_buffer("qweight", packed.contiguous())
            self.register_buffer("scales", scales.to(scale_dtype or dtype).contiguous())
            self.register_buffer("zeros", None if zeros is None else zeros.contiguous())
            self.register_buffer("mins", None if mins is None else mins.to(scale_dtype or dtype).contiguous())

    def _mm(self, x):
        x = x.to(self.dtype)
        if self.kernel == "weight_int4pack_mm_for_cpu":
            return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.qweight, self.group_size,
                                                     self.scales_and_zeros)
        if self.kernel == "triton_w4a16":
            from kiln.engine.kernels.quant_gemm import w4a16_gemm
            return w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size, mins=self.mins)
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def dequantized_weight(self):
        if self.kernel != "weight_int4pack_mm_for_cpu":
            return dequantize_int4(self.qweight, self.scales, self.zeros, self.mins)
        # Recover the weight through the op itself: the identity matrix times W^T.
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.qweight.device)
        return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scales_and_zeros).T.float()


class Fp8Linear(QuantLinear):
    method = "fp8"

    def __init__(self, weight, scales, bias=None, act_scale=None, dtype=torch.float32) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias, act_scale, dtype)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        scaled_mm = (weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (8, 9)
                     and dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)
        self.kernel = "scaled_mm" if scaled_mm else "dequantize"
        if weight.is_cuda and not scaled_mm:
            # warnings, not logging: said once per process, not once per layer
            warnings.warn("fp8 on this GPU/dtype has no float8 matmul (needs sm89+, bfloat16, dimensions "
                          "divisible by 16): fp8 weights are dequantized per matmul instead", RuntimeWarning)

    def _mm(self, x):
        x = x.to(self.dtype)
        if self.kernel == "scaled_mm" and x.shape[0] > 0:
            # W8A8: each activation row quantized to e4m3 with its own scale, fp32 accumulation.
            x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
            xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scales.view(1, -1),
                                    out_dtype=self.dtype)
        if x.dtype == torch.float16:
            # The codes (up to 448) times activations overflow float16's 65504 in the K sum:
            # scale the weight first.
            return F.linear(x, self.dequantized_weight().to(x.dtype))
        # e4m3 -> float is exact; the per-row scale factors out of the K sum.
        return F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)

    def dequantized_weight(self):
        return dequantize_fp8(self.weight, self.scales)


# ---------------------------------------------------------------------------------------------
# the model-level API
# ---------------------------------------------------------------------------------------------
def quantizable_linears(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The decoder layers' projections (the kiln Llama model's fused names); never embeddings or lm_head."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _LINEARS and hasattr(module, "weight") and not isinstance(module, QuantLinear):
            yield name, module


class Quantizer:
    """gpt-fast style: `create_quantized_state_dict()` then `convert_for_runtime(state_dict)`.

    The state dict holds, per quantized Linear `name`: `name.qweight` (+ `name.scales`, `name.zeros`
    for int4; fp8's weight is `name.qweight` too), `name.bias` if any, `name.act_scale` where AWQ
    kept a multiplier; and, for AWQ, the rescaled norm weights under their own names, with the
    `norm.folded_scale` s each was divided by: the projections after it see x / s, and a LoRA
    adapter's A, made for x, is scaled by s to match (kiln.engine.lora)."""

    def __init__(self, model: nn.Module, method: str, *, group_size: int | None = None,
                 calibration_ids: list[int] | None = None, tokenizer: Any = None) -> None:
        self.model, self.method = model, check_method(method)
        self.group_size, self.calibration_ids, self.tokenizer = group_size, calibration_ids, tokenizer

    @torch.no_grad()
    def create_quantized_state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self.method == "none":
            return out
        awq: dict[str, torch.Tensor] = {}  # per-input-channel s (W' = W diag(s)) where AWQ applies
        act_scales: dict[str, torch.Tensor] = {}
        if self.method in ACTIVATION_AWARE:
            from kiln.engine.awq import awq_scales
            ids = self.calibration_ids
            if ids is None:
                from kiln.engine.awq import calibration_token_ids
                ids = calibration_token_ids(self.tokenizer)
            for name, (s, norm) in awq_scales(self.model, ids, self.method, self.group_size).items():
                awq[name] = s  # W' = W diag(s); the input becomes x / s
                if norm is not None:
                    norm_w = self.model.get_submodule(norm).weight
                    out[f"{norm}.weight"] = (norm_w.float() / s).to(norm_w.dtype)
                    out[f"{norm}.folded_scale"] = s.float()
                else:
                    act_scales[name] = 1.0 / s
        for name, module in quantizable_linears(self.model):
            w = module.weight.detach().float()  # one float32 copy at a time
            if name in awq:
                w = w * awq[name]
            if self.method == "int8":
                out[f"{name}.qweight"], out[f"{name}.scales"] = quantize_int8(w)
            elif self.method in ("int4", "int4-rtn"):
                packed, scales, zeros = quantize_int4(w, self.group_size)
                out[f"{name}.qweight"], out[f"{name}.scales"], out[f"{name}.zeros"] = packed, scales, zeros
            else:
                out[f"{name}.qweight"], out[f"{name}.scales"] = quantize_fp8(w)
            if getattr(module, "bias", None) is not None:
                out[f"{name}.bias"] = module.bias.detach()
            if name in act_scales:
                out[f"{name}.act_scale"] = act_scales[name]
        return out

    @torch.no_grad()
    def convert_for_runtime(self, state_dict: dict[str, torch.Tensor]) -> nn.Module:
        """Swap every quantizable Linear for its QuantLinear built from state_dict (on the Linear's
        device, in its dtype), and copy any other tensors (rescaled norms) into the model."""
        for name, module in list(quantizable_linears(self.model)):
            if f"{name}.qweight" not in state_dict:
                continue
            dev, dtype = module.weight.device, module.weight.dtype

            def get(key: str, name: str = name, dev: torch.device = dev) -> torch.Tensor | None:
                tensor = state_dict.get(f"{name}.{key}")
                return None if tensor is None else tensor.to(dev)
            common = dict(bias=get("bias"), act_scale=get("act_scale"), dtype=dtype)
            if self.method == "int8":
                new = Int8Linear(get("qweight"), get("scales"), **common)
            elif self.method in ("int4", "int4-rtn"):
                new = Int4Linear(get("qweight"), get("scales"), get("zeros"), **common)
            else:
                new = Fp8Linear(get("qweight"), get("scales"), **common)
            parent, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, child, new)
        params = dict(self.model.named_parameters())
        for key, tensor in state_dict.items():
            if key in params:
                params[key].data.copy_(tensor)
            elif key.endswith(".folded_scale"):
                norm = self.model.get_submodule(key.removesuffix(".folded_scale"))
                norm.folded_scale = tensor.to(norm.weight.device, torch.float32)
        return self.model


def quantize_model(model: nn.Module, method: str, **kwargs: Any) -> nn.Module:
    """Quantize model's decoder Linears in place ("none": unchanged) and return it."""
    if check_method(method) == "none":
        return model
    quantizer = Quantizer(model, method, **kwargs)
    return quantizer.convert_for_runtime(quantizer.create_quantized_state_dict())


def resident_weight_bytes(model: nn.Module, linears_only: bool = False) -> int:
    """Bytes of the weights the model holds: parameters and persistent buffers (not the rotary
    table). linears_only: only the decoder projections, float or quantized."""
    total = 0
    for name, module in model.named_modules():
        if linears_only and not (isinstance(module, QuantLinear) or name.rsplit(".", 1)[-1] in _LINEARS):
            continue
        tensors = list(module.parameters(recurse=False))
        tensors += [b for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
