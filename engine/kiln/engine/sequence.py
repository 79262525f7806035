"""One request's life inside the engine: its tokens, its place in the KV cache, its status."""
from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from kiln.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.engine.lora import LoRAAdapter


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or preempted and waiting to be recomputed
    RUNNING = auto()  # owns blocks and takes part in steps
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
                 lora: LoRAAdapter | None = None):
        self.request_id = request_id
        self.params = params
        self.lora = lora  # the adapter its tokens run with (kiln.engine.lora); None: the base model
        self.arrival = arrival  # FCFS order, also across preemptions
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        # K/V of token_ids[:num_computed_tokens] sit in the cache; the rest still has to run.
        self.num_computed_tokens = 0
        # Of the computed tokens, how many came for free from the prefix cache at admission.
        self.num_cached_tokens = 0
        self.admitted = False  # given blocks once already (a preempted sequence comes back)
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks, filled lazily by the block manager.
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0  # leading blocks already offered to the prefix cache
        # The last num_draft_tokens of token_ids are speculative guesses for this step, not yet
        # checked by the model (kiln.engine.speculative).
        self.num_draft_tokens = 0
        # With a draft model: its K/V of token_ids[:num_draft_cached] sit in its cache (kiln.engine.draft_model).
        self.num_draft_cached = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # why, when finish_reason is "error"
        # vLLM's stop_reason: the stop string or the request's stop token that ended it; None for
        # EOS and every other finish.
        self.stop_reason: str | int | None = None
        # Tokens that end it: the request's stop_token_ids and, unless ignore_eos, the model's EOS
        # (set by the engine, which knows the tokenizer).
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids or ())
        self.logprobs: list[dict[str, Any]] | None = [] if params.logprobs is not None else None
        # With params.prompt_logprobs: entry i scores prompt token i (kiln.engine.prompt_logprobs);
        # token 0 has nothing before it, hence None. Filled in position order as the prefill runs.
        self.prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        # Output-side state, owned by the engine's output processing.
        self.generator: Any = None
        # With params.structured_outputs: what may come next (kiln.engine.structured_output).
        self.matcher: Any = None
        self.prompt_mask: Any = None  # which vocabulary tokens its prompt holds, for penalties (sampler)
        self.detokenizer: Any = None
        self.text = ""
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def may_stop(self) -> bool:
        """False while fewer than min_tokens are out: nothing may end it yet (vLLM's rule)."""
        return self.num_output_tokens >= self.params.min_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens that still need a forward pass before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_logprob_rows(self) -> range:
        """Positions whose logits the prompt logprobs still need: position p's logits score
        prompt token p + 1. Empty once all are recorded, so a recompute after preemption
        records nothing twice."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(len(self.prompt_logprobs) - 1, self.num_prompt_tokens - 1)

    @property
    def num_reusable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last (its forward
        yields the next token's logits), and none from the first position whose logits the
        prompt logprobs still need: a cache hit skips the forward that would produce them."""
        rows = self.prompt_logprob_rows
        return rows.start if rows else len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_drafts(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.num_draft_tokens += len(token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    def drop_drafts(self, count: int | None = None) -> None:
        """Take the last `count` drafts (all by default) off the sequence."""
        if not self.num_draft_tokens:  # the common case, per sequence per step: nothing to take
            return
        count = self.num_draft_tokens if count is None else min(count, self.num_draft_tokens)
        del self.token_ids[len(self.token_ids) - count:]
        self.num_draft_tokens -= count

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
