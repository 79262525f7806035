"""Per-step attention metadata. The model runner sets it before a forward; every
Attention layer reads it, so the model's forward signature stays (input_ids, positions)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kiln.engine.lora import LoRAMapping


@dataclass
class Context:
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: offsets of each sequence's new tokens in the flat batch
    seq_lens: torch.Tensor  # int32 [B]: context length of each sequence after this step
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor  # int64 [N]: cache slot of each new token's K/V (-1 = skip)
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded
    lora: LoRAMapping | None = None  # the rows of each LoRA adapter in the step (kiln.engine.lora)
    # what the backend derives from the metadata once per step, before the layer loop, and every
    # layer reuses (kiln.engine.attention.prepare_step)
    derived: dict = field(default_factory=dict, repr=False, compare=False)


_CONTEXT: Context | None = None


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def get_context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("no attention context set: call set_context() before the model's forward")
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None


def prefill_context(seq_lens: list[int], device: torch.device | str = "cpu") -> Context:
    """A context for plain prefills of the given lengths with no KV cache (slots -1):
    what a one-shot forward, e.g. a logits comparison, needs."""
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens, 0)
    return Context(cu_seqlens_q=cu, seq_lens=lens, max_seqlen_q=max(seq_lens), max_seqlen_k=max(seq_lens),
                   slot_mapping=torch.full((sum(seq_lens),), -1, dtype=torch.int64, device=device),
                   block_tables=torch.zeros((len(seq_lens), 0), dtype=torch.int32, device=device))
