"""Runs one scheduled batch through the model: owns the KV pool, builds the flat batch and its
attention Context, computes logits only for rows that sample (and the prompt rows of requests
that asked for prompt logprobs), and samples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.engine import startup
from kiln.engine.attention import Attention
from kiln.engine.config import Config, ModelConfig
from kiln.engine.context import Context, reset_context, set_context
from kiln.engine.kv_quant import SCALE_DTYPE, is_quantized, kv_bytes_per_token_head
from kiln.engine.llama import LlamaForCausalLM
from kiln.engine.prompt_logprobs import ScoredPosition, rows_per_chunk, score_rows
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, scales of an int8/fp8 cache included."""
    heads = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads
    return heads * block_size * kv_bytes_per_token_head(model_config.head_dim, dtype)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # int64 [N]: every new token of the batch, flattened
    positions: torch.Tensor  # int64 [N]
    context: Context
    sample_rows: list[int]  # the last row of each sequence whose tokens will all be computed
    # (sequence, its first flat row, positions): rows whose logits score prompt tokens (prompt logprobs)
    prompt_rows: list[tuple[Sequence, int, range]]


@dataclass
class RunnerOutput:
    sampled: list[Sequence]  # the sequences that got a token, in batch order
    tokens: list[int]
    logprobs: list[dict[str, Any] | None]
    # Prompt positions scored this step, per sequence in order, following those already recorded.
    prompt_logprobs: list[tuple[Sequence, list[ScoredPosition]]]


def prompt_rows_in_step(seq: Sequence, start: int, end: int) -> range:
    """Of the positions [start, end) a sequence runs this step, those whose logits its prompt
    logprobs still need (Sequence.prompt_logprob_rows). A recompute after preemption runs
    positions already recorded again; those are left out."""
    needed = seq.prompt_logprob_rows
    # The prefix cache never skips a needed position (Sequence.num_reusable_tokens).
    assert not needed or needed.start >= start, f"{seq.request_id}: prompt position {needed.start} was skipped"
    return range(max(start, needed.start), min(end, needed.stop))


class ModelRunner:
    def __init__(self, config: Config, model: LlamaForCausalLM, model_config: ModelConfig):
        self.model = model
        self.device = config.torch_device
        self.block_size = config.block_size
        self.sampler = Sampler(config.seed, self.device, model.backend.argmax)
        self.prompt_logprob_chunk = rows_per_chunk(model_config.vocab_size)
        with startup.phase("kv_alloc"):
            self.num_blocks = self._allocate_kv_cache(config, model_config)

    def _allocate_kv_cache(self, config: Config, model_config: ModelConfig) -> int:
        """Size the pool from the memory budget and allocate it; returns its block count."""
        self.kv_dtype = config.kv_cache_torch_dtype
        block_bytes = kv_block_bytes(model_config, config.block_size, self.kv_dtype)
        num_blocks = config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block; one block of "
                f"{config.block_size} tokens needs {block_bytes} bytes for this model"
            )
        self.kv_shape = (2, len(self._attention_layers()), num_blocks, config.block_size,
                         model_config.num_key_value_heads, model_config.head_dim)
        self.allocate_kv_cache()
        return num_blocks

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def allocate_kv_cache(self) -> None:
        """One tensor for the whole pool; each layer gets a view. An int8/fp8 cache has a second
        tensor of scales, one per (slot, KV head)."""
        # Left uninitialised: attention never reads a slot past a sequence's length.
        self.kv_cache = torch.empty(self.kv_shape, dtype=self.kv_dtype, device=self.device)
        self.kv_scales = torch.empty(self.kv_shape[:-1], dtype=SCALE_DTYPE, device=self.device) \
            if is_quantized(self.kv_dtype) else None
        for i, layer in enumerate(self._attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            # Always set: a float pool must clear the scales an earlier quantized pool left on the layer.
            layer.k_scales, layer.v_scales = (None, None) if self.kv_scales is None else \
                (self.kv_scales[0, i], self.kv_scales[1, i])

    def release_kv_cache(self) -> None:
        """Give the pool's memory back (sleep). Every reference goes, the layers' views too, so
        the allocator can return it; on CUDA the caching allocator is emptied as well."""
        for layer in self._attention_layers():
            layer.k_cache = layer.v_cache = layer.k_scales = layer.v_scales = None
        self.kv_cache = self.kv_scales = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        """Flat input_ids/positions of every new token, the Context, and which rows need logits."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens, seq_lens, sample_rows, prompt_rows = [0], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            offset = cu_seqlens[-1] - start  # the flat row of position p is offset + p
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(end)
            if end == len(seq):
                sample_rows.append(cu_seqlens[-1] - 1)
            scored = prompt_rows_in_step(seq, start, end)
            if scored:
                prompt_rows.append((seq, offset + scored.start, scored))
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        dev = self.device
        context = Context(
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_seqlen_q=max(batch.num_new_tokens),
            max_seqlen_k=max(seq_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        )
        return PreparedBatch(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                             torch.tensor(positions, dtype=torch.int64, device=dev), context, sample_rows,
                             prompt_rows)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """One forward over the batch: tokens and logprob entries for the sequences that sample,
        and the prompt positions scored for those that asked for prompt logprobs."""
        prepared = self.prepare(batch)
        set_context(prepared.context)
        try:
            hidden = self.model(prepared.input_ids, prepared.positions)
        finally:
            reset_context()
        prompt_logprobs = [(seq, self._score_prompt(seq, hidden[row:row + len(positions)], positions))
                           for seq, row, positions in prepared.prompt_rows]
        sampled = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_computed_tokens + n == len(seq)]
        if not sampled:
            return RunnerOutput([], [], [], prompt_logprobs)
        logits = self.model.compute_logits(hidden[prepared.sample_rows])
        tokens, logprobs = self.sampler(logits, sampled)
        return RunnerOutput(sampled, tokens, logprobs, prompt_logprobs)

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, positions: range) -> list[ScoredPosition]:
        """Score the prompt tokens that follow these positions; hidden holds their rows."""
        targets = seq.token_ids[positions.start + 1:positions.stop + 1]
        return score_rows(self.model.compute_logits, hidden, targets, seq.params.prompt_logprobs,
                          self.prompt_logprob_chunk)
