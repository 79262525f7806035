"""GGUF's Q8_0, Q4_0 and Q4_1 matrices in Kiln's weight-only formats (kiln.engine.quantization),
bit for bit, so a GGUF's decoder projections can be served packed instead of dequantized.

Each format has blocks of 32 weights along a row (K), one float16 scale d per block:
  Q8_0  w = d * q, q int8               -> int8, group-wise scales [N, K // 32]
  Q4_0  w = d * (q - 8), q in 0..15     -> int4, group 32, implicit zero 8 (zeros=None), scale d
  Q4_1  w = d * q + m, q in 0..15       -> int4, group 32, float mins m (float16), scale d
Scales and mins keep the file's float16: converted to float32 they are exact, and the products
d * q are exact in float32 (at most 11 + 8 bits), so dequantizing the Kiln form gives gguf's own
float32 dequantization. A block stores its 32 4-bit codes in 16 bytes, element j in byte j's low
nibble and element j + 16 in its high one; Kiln packs elements 2i and 2i + 1 into byte i.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import gguf
import numpy as np
import torch

from kiln.engine.gguf_file import GGUFTensor
from kiln.engine.quantization import Int4Linear, Int8Linear, QuantLinear, dequantize_int4, dequantize_int8, pack_int4

PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1")
BLOCK = 32


@dataclass
class PackedWeight:
    """One matrix [N, K] (rows = output channels) in Kiln's form of a GGUF type."""

    kind: str  # the GGUF type: Q8_0, Q4_0 or Q4_1
    qweight: torch.Tensor  # int8 [N, K] (Q8_0) or int4 codes packed two a byte, uint8 [N, K // 2]
    scales: torch.Tensor  # float16 [N, K // 32]
    mins: torch.Tensor | None = None  # float16 [N, K // 32], Q4_1 only

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedWeight:
        """The same weight with fn (a permutation of dim 0) applied to every per-row tensor: exact,
        since each row carries its own codes, scales and mins."""
        return replace(self, qweight=fn(self.qweight), scales=fn(self.scales),
                       mins=None if self.mins is None else fn(self.mins))

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Stack weights of one kind along N (Kiln's fused qkv_proj and gate_up_proj)."""
        if len({p.kind for p in parts}) != 1:
            raise ValueError(f"cannot fuse GGUF types {[p.kind for p in parts]}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return PackedWeight(parts[0].kind, torch.cat([p.qweight for p in parts]),
                            torch.cat([p.scales for p in parts]), mins)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], equal to gguf's dequantization."""
        if self.kind == "Q8_0":
            return dequantize_int8(self.qweight, self.scales)
        return dequantize_int4(self.qweight, self.scales, None, self.mins)

    def to_linear(self, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        """The runtime module on device, computing in dtype; scales and mins stay float16."""
        scales = self.scales.to(device)
        if self.kind == "Q8_0":
            return Int8Linear(self.qweight.to(device), scales, bias=bias, dtype=dtype, scale_dtype=torch.float16)
        mins = None if self.mins is None else self.mins.to(device)
        return Int4Linear(self.qweight.to(device), scales, None, bias=bias, dtype=dtype, mins=mins,
                          scale_dtype=torch.float16)


class Blocks(NamedTuple):
    """The blocks of a Q8_0/Q4_0/Q4_1 tensor, one row per block, split into their fields."""

    codes: np.ndarray  # [blocks, 32]: int8 (Q8_0) or 0..15 as uint8, in the weights' order
    scales: np.ndarray  # float16 [blocks]
    mins: np.ndarray | None  # float16 [blocks], Q4_1 only


def split_blocks(raw: np.ndarray, kind: str) -> Blocks:
    """A Q8_0/Q4_0/Q4_1 tensor's bytes (whole blocks, any shape) as their fields; ValueError otherwise."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = raw.reshape(-1, block_bytes)

    def f16(start: int) -> np.ndarray:  # a float16 field of every block
        return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0]

    if kind == "Q8_0":
        return Blocks(blocks[:, 2:].view(np.int8), f16(0), None)
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # GGUF's order: the low nibbles first
    return Blocks(codes, f16(0), f16(2) if kind == "Q4_1" else None)


def dequantize_blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """float32 [blocks, 32]: gguf.quants.dequantize's values bit for bit, twice as fast (one pass over
    whole tensors instead of its groups of rows)."""
    blocks = split_blocks(raw, kind)
    w = blocks.codes.astype(np.float32)
    if kind == "Q4_0":
        w -= 8
    w *= blocks.scales.astype(np.float32)[:, None]
    if blocks.mins is not None:
        w += blocks.mins.astype(np.float32)[:, None]
    return w


def read_packed(tensor: GGUFTensor) -> PackedWeight:
    """A Q8_0/Q4_0/Q4_1 GGUF matrix as a PackedWeight; raises ValueError on a short or odd tensor."""
    kind = tensor.tensor_type.name
    if kind not in PACKED_TYPES:
        raise ValueError(f"tensor {tensor.name!r} has type {kind}; only {', '.join(PACKED_TYPES)} stay packed")
    rows, cols = (int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    _, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    raw = np.asarray(tensor.data, dtype=np.uint8)  # the memory map (gguf_file); the fields are copies
    if raw.size != rows * cols // BLOCK * block_bytes or cols % BLOCK:
        raise ValueError(f"tensor {tensor.name!r}: {raw.size} bytes do not hold [{rows}, {cols}] as {kind}")
    blocks = split_blocks(raw, kind)
    codes = torch.from_numpy(np.ascontiguousarray(blocks.codes).reshape(rows, cols))
    scales = torch.from_numpy(blocks.scales.reshape(rows, cols // BLOCK))
    if kind == "Q8_0":
        return PackedWeight(kind, codes, scales)
    mins = None if blocks.mins is None else torch.from_numpy(blocks.mins.reshape(rows, cols // BLOCK))
    return PackedWeight(kind, pack_int4(codes), scales, mins)
