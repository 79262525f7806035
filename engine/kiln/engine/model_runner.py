"""Runs one scheduled batch through the model: owns the KV pool, builds the flat batch and its
attention Context, computes logits only for rows that sample (and the prompt rows of requests
that asked for prompt logprobs), and samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kiln.engine import startup
from kiln.engine.attention import Attention
from kiln.engine.config import CPU_KV_CACHE_MEMORY, Config, ModelConfig
from kiln.engine.context import Context, prefill_context, reset_context, set_context
from kiln.engine.kernels.cuda_graphs import DecodeGraphs
from kiln.engine.kv_quant import SCALE_DTYPE, is_quantized, kv_bytes_per_token_head
from kiln.engine.llama import LlamaForCausalLM
from kiln.engine.lora import LoRAAdapter, install_hooks, lora_mapping
from kiln.engine.prompt_logprobs import ScoredPosition, rows_per_chunk, score_rows
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence

log = logging.getLogger(__name__)
GiB = 2 ** 30


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, scales of an int8/fp8 cache included."""
    heads = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads
    return heads * block_size * kv_bytes_per_token_head(model_config.head_dim, dtype)


def gpu_kv_budget(total: int, free: int, reserved: int, peak: int, utilization: float) -> int:
    """KV cache bytes on a GPU, as vLLM sizes it: this engine may take `utilization` of the
    card; what torch's allocator peaked at (weights plus a max-size step's activations) and what
    it does not hold (the CUDA context, other processes: total - free - reserved) come off."""
    others = total - free - reserved
    budget = int(total * utilization) - peak - others
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: {utilization * total / GiB:.1f} GiB "
            f"allowed, {peak / GiB:.1f} GiB for the weights and activations, {others / GiB:.1f} GiB held outside "
            "this engine; raise gpu_memory_utilization or set kv_cache_memory")
    return budget


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: powers of two up to max_num_seqs, and max_num_seqs itself
    (a batch runs in the smallest captured size that holds it)."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


def sampled_rows(config: Config) -> int:
    """The most logit rows one step samples: one a sequence, and with speculation one more a draft."""
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return min(config.max_num_batched_tokens, config.max_num_seqs * (drafts + 1))


def profile_seq_lens(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Prompts that fill the largest step the scheduler can make, for the memory profile."""
    full, rest = divmod(max_num_batched_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # int64 [N]: every new token of the batch, flattened
    positions: torch.Tensor  # int64 [N]
    context: Context
    # The last row of each sequence whose tokens will all be computed (the last 1 + drafts rows
    # of one with drafts).
    sample_rows: list[int]
    sampled: list[Sequence]  # per sample row, its sequence
    drafts: list[int] | None  # per sample row, the draft token it checks, or -1; None: no row checks one
    # (sequence, its first flat row, positions): rows whose logits score prompt tokens (prompt logprobs)
    prompt_rows: list[tuple[Sequence, int, range]]


@dataclass
class RunnerOutput:
    # The sequences that got a token, in batch order; one with drafts once per row it sampled.
    sampled: list[Sequence]
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
    def __init__(self, config: Config, model: LlamaForCausalLM, model_config: ModelConfig, shared_block_bytes: int = 0):
        """shared_block_bytes: what each block also costs elsewhere (a draft model's cache, which has
        a block for each of this pool's): the memory budget pays for both."""
        self.model = model
        self.device = config.torch_device
        self.block_size = config.block_size
        # Host tensors of a step go to the GPU from pinned memory, without blocking the host.
        self.pin_memory = self.device.type == "cuda"
        self.sampler = Sampler(config.seed, self.device, model.backend.argmax)
        self.prompt_logprob_chunk = rows_per_chunk(model_config.vocab_size)
        self.graphs: DecodeGraphs | None = None
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs) if self._can_use_graphs(config) else []
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.applies_lora = config.enable_lora
        if self.applies_lora:
            install_hooks(model)
        with startup.phase("kv_alloc"):
            self.num_blocks = self._allocate_kv_cache(config, model_config, shared_block_bytes)

    def _can_use_graphs(self, config: Config) -> bool:
        # Only the Triton backend's forward is free of host syncs; tensor-parallel ranks run eagerly.
        return (self.device.type == "cuda" and self.model.backend.name == "triton" and not config.enforce_eager
                and config.tensor_parallel_size == 1)

    def _allocate_kv_cache(self, config: Config, model_config: ModelConfig, shared_block_bytes: int) -> int:
        """Size the pool from the memory budget and allocate it; returns its block count."""
        self.kv_dtype = config.kv_cache_torch_dtype
        block_bytes = kv_block_bytes(model_config, config.block_size, self.kv_dtype)
        memory, self.kv_source = self._kv_budget(config)
        num_blocks = memory // (block_bytes + shared_block_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={memory} bytes holds no KV block; one block of "
                f"{config.block_size} tokens needs {block_bytes + shared_block_bytes} bytes for this model"
                + (" and its draft model" if shared_block_bytes else "")
            )
        self.kv_shape = (2, len(self._attention_layers()), num_blocks, config.block_size,
                         model_config.num_key_value_heads, model_config.head_dim)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s)", num_blocks, config.block_size,
                 num_blocks * config.block_size, num_blocks * block_bytes / GiB, self.kv_source)
        try:
            self.allocate_kv_cache()
        except (RuntimeError, MemoryError) as e:  # torch's CPU "can't allocate", CUDA's OutOfMemoryError
            if "alloc" not in str(e).lower() and "memory" not in str(e).lower():
                raise
            raise ValueError(f"the KV cache ({num_blocks * block_bytes / GiB:.2f} GiB, {self.kv_source}) cannot be "
                             f"allocated on {self.device}: ask for less memory") from None
        return num_blocks

    def _kv_budget(self, config: Config) -> tuple[int, str]:
        """The pool's bytes, and what set them (for the start-up log)."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory, "kv_cache_memory"
        if self.device.type != "cuda":
            return CPU_KV_CACHE_MEMORY, "the CPU default"
        return self._measure_gpu_kv_budget(config), f"gpu_memory_utilization={config.gpu_memory_utilization}"

    @torch.inference_mode()
    def _measure_gpu_kv_budget(self, config: Config) -> int:
        """Run the largest step the scheduler can make (no KV cache yet: plain prefill) and its
        logits, and size the pool from the allocator's peak and what the card has free."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        lens = profile_seq_lens(config.max_num_batched_tokens, self.max_model_len)
        n = sum(lens)
        set_context(prefill_context(lens, self.device))
        try:
            hidden = self.model(torch.zeros(n, dtype=torch.int64, device=self.device),
                                torch.cat([torch.arange(length, device=self.device) for length in lens]))
        finally:
            reset_context()
        logits = self.model.compute_logits(hidden[:1].expand(sampled_rows(config), -1))
        # The sampler's largest temporaries, alive at once: log-probabilities and top-k/top-p's sort.
        logprobs, ordered = torch.log_softmax(logits, dim=-1), torch.sort(logits, dim=-1)
        del hidden, logits, logprobs, ordered
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = gpu_kv_budget(total, free, torch.cuda.memory_reserved(self.device), peak,
                               config.gpu_memory_utilization)
        log.info("GPU memory: %.1f GiB card, weights + activations peak %.2f GiB, KV budget %.2f GiB "
                 "(gpu_memory_utilization=%s)", total / GiB, peak / GiB, budget / GiB, config.gpu_memory_utilization)
        return budget

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
        if self.graph_sizes:  # graphs hold the pool's addresses: captured anew for each pool
            with startup.phase("cuda_graphs"):
                self.graphs = DecodeGraphs(self.model.forward, self.graph_sizes,
                                           -(-self.max_model_len // self.block_size), self.max_model_len, self.device)
                self.graphs.capture()
            log.info("CUDA graphs captured for decode batches of %s", self.graph_sizes)

    def close(self) -> None:
        """Nothing runs beside one rank (a tensor-parallel rank 0's runner stops its workers)."""

    def release_kv_cache(self) -> None:
        """Give the pool's memory back (sleep). Every reference goes, the layers' views and the
        graphs that captured them too, so the allocator can return it; on CUDA the caching
        allocator is emptied as well."""
        for layer in self._attention_layers():
            layer.k_cache = layer.v_cache = layer.k_scales = layer.v_scales = None
        self.kv_cache = self.kv_scales = self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def add_lora(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """The adapter, read for the whole model, as this runner's model applies it (a
        tensor-parallel leader cuts it and hands the workers theirs)."""
        return adapter

    def remove_lora(self, adapter: LoRAAdapter) -> None:
        """No step names the adapter any more (a tensor-parallel leader tells the workers)."""

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        """Flat input_ids/positions of every new token, the Context, and which rows need logits."""
        spans = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
                 for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        input_ids, positions, context = self.flatten(spans)
        sample_rows, sampled, drafts, prompt_rows, row, checks_drafts = [], [], [], [], 0, False
        for seq, start, end in spans:
            row += end - start  # one past the sequence's last flat row; position p is row - end + p
            if end == len(seq):  # and with drafts, the rows that check them too
                if seq.num_draft_tokens:
                    checks_drafts = True
                    sample_rows += range(row - 1 - seq.num_draft_tokens, row)
                    sampled += [seq] * (seq.num_draft_tokens + 1)
                    drafts += seq.draft_token_ids + [-1]
                else:  # the common case, kept cheap: it runs per sequence per step
                    sample_rows.append(row - 1)
                    sampled.append(seq)
                    drafts.append(-1)
            if seq.prompt_logprobs is not None:
                scored = prompt_rows_in_step(seq, start, end)
                if scored:
                    prompt_rows.append((seq, row - end + scored.start, scored))
        return PreparedBatch(input_ids, positions, context, sample_rows, sampled, drafts if checks_drafts else None,
                             prompt_rows)

    def flatten(self, spans: list[tuple[Sequence, int, int]]) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """The tokens at positions [start, end) of each sequence as one flat batch: input_ids,
        positions and the attention Context (their K/V go to the sequence's blocks)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens, seq_lens = [0], []
        for seq, start, end in spans:
            table = seq.block_table
            if end - start == 1:  # a decode: appends, a quarter of the general case's time per sequence
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:end]
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            seq_lens.append(end)
        width = max(len(seq.block_table) for seq, _, _ in spans)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _, _ in spans]
        to_device = self._to_device
        context = Context(
            cu_seqlens_q=to_device(cu_seqlens, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            max_seqlen_q=max(end - start for _, start, end in spans),
            max_seqlen_k=max(seq_lens),
            slot_mapping=to_device(slots, torch.int64),
            block_tables=to_device(tables, torch.int32),
            lora=lora_mapping([(seq.lora, end - start) for seq, start, end in spans], self.device)
            if self.applies_lora else None,
        )
        return to_device(input_ids, torch.int64), to_device(positions, torch.int64), context

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin_memory:
            return torch.tensor(values, dtype=dtype, device=self.device)
        # The caching host allocator keeps the pinned buffer until the copy has run.
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """One forward over the batch: tokens and logprob entries for the sequences that sample,
        and the prompt positions scored for those that asked for prompt logprobs."""
        prepared = self.prepare(batch)
        # Graphs replay the base model's kernels only: steps with LoRA adapters run eagerly.
        if self.graphs is not None and prepared.context.lora is None and self.graphs.can_run(prepared.context):
            hidden = self.graphs.run(prepared.input_ids, prepared.positions, prepared.context)
        else:
            hidden = self._forward(prepared.input_ids, prepared.positions, prepared.context)
        prompt_logprobs = [(seq, self._score_prompt(seq, hidden[row:row + len(positions)], positions))
                           for seq, row, positions in prepared.prompt_rows]
        sampled, rows = prepared.sampled, prepared.sample_rows
        if not sampled:
            return RunnerOutput([], [], [], prompt_logprobs)
        # Every row samples (decodes only): no gather, which from a list of rows is a host-to-device copy.
        logits = self.model.compute_logits(hidden if len(rows) == hidden.shape[0] else hidden[rows])
        tokens, logprobs = self.sampler(logits, sampled, prepared.drafts)
        return RunnerOutput(sampled, tokens, logprobs, prompt_logprobs)

    @torch.inference_mode()
    def last_logits(self, spans: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """Run the spans eagerly (their K/V go to the cache) and return the logits of each one's
        last position: what a draft model guesses from (kiln.engine.draft_model)."""
        input_ids, positions, context = self.flatten(spans)
        hidden = self._forward(input_ids, positions, context)
        return self.model.compute_logits(hidden[context.cu_seqlens_q[1:].long() - 1])

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        set_context(context)
        try:
            return self.model(input_ids, positions)
        finally:
            reset_context()

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, positions: range) -> list[ScoredPosition]:
        """Score the prompt tokens that follow these positions; hidden holds their rows."""
        targets = seq.token_ids[positions.start + 1:positions.stop + 1]
        return score_rows(self.model.compute_logits, hidden, targets, seq.params.prompt_logprobs,
                          self.prompt_logprob_chunk)
