"""Speculative decoding with a draft model (vLLM's `{"method": "draft_model", "model": ...}`): a
smaller model of the same vocabulary guesses the next k tokens, greedily, one at a time, and the
target checks them in one step as it checks n-gram drafts (kiln.engine.speculative), so the
output is what the target alone gives (greedy: the same tokens; sampled: the same distribution).

The draft model keeps its own KV cache with as many blocks as the target's and the same block
ids: a sequence's block table addresses both, so the scheduler allocates for both at once, and
the memory budget pays for both, block for block. Before scheduling, the engine gives each
sequence that may speculate k placeholder drafts; the scheduler trims them to its budget and
allocates their blocks; then fill() runs the draft model, first over whatever of the sequence
its cache lacks (the prompt, the tokens the last step kept), then over one guess at a time,
writing each guess over a placeholder. Sequence.num_draft_cached says how much of its cache is
still the sequence's: it falls back to the tokens kept after each check, and to 0 when a
preemption takes the blocks.
"""
from __future__ import annotations

from dataclasses import replace

from kiln.engine.config import Config, ModelConfig
from kiln.engine.loader import load_model
from kiln.engine.model_runner import ModelRunner, kv_block_bytes
from kiln.engine.sequence import Sequence


class DraftModel:
    def __init__(self, config: Config, target: ModelConfig) -> None:
        spec = config.speculative
        # The target's settings, its dtype and device above all; eager (its steps are small and varied);
        # whole on rank 0 of a tensor-parallel target (a draft is small), every rank's pool paying its blocks.
        # No adapters: the draft guesses with its own weights for every request, an adapter's too (the target
        # checks the guesses with the adapter), and the target's adapters are not its to load.
        self.config = replace(config, model=spec.model, quantization=spec.quantization, speculative=None,
                              enforce_eager=True, tensor_parallel_size=1, enable_lora=False, lora_modules=())
        try:
            self.loaded = load_model(self.config)
        except ValueError as e:  # its own words (a context too short, a name not found) name no draft
            raise ValueError(f"the draft model {spec.model!r}: {e}") from None
        draft = self.loaded.model_config
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the "
                             f"target {target.vocab_size}: a draft must share the target's tokenizer")
        self.block_bytes = kv_block_bytes(draft, config.block_size, config.kv_cache_torch_dtype)
        self.runner: ModelRunner | None = None

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV cache: num_blocks blocks, as many as the target's pool."""
        self.runner = ModelRunner(replace(self.config, kv_cache_memory=num_blocks * self.block_bytes),
                                  self.loaded.model, self.loaded.model_config)
        assert self.runner.num_blocks == num_blocks

    def fill(self, seqs: list[Sequence]) -> None:
        """Replace the placeholder drafts of these sequences with the draft model's guesses."""
        # (sequence, first position to run, one past the last): the first pass catches the
        # draft's cache up to the token pending for the target; its logits guess the first draft.
        spans = [(seq, seq.num_draft_cached, len(seq) - seq.num_draft_tokens) for seq in seqs if seq.num_draft_tokens]
        spans = self._catch_up(spans, self.config.max_num_batched_tokens)
        while spans:
            guesses = self.runner.model.backend.argmax(self.runner.last_logits(spans)).tolist()
            following = []
            for (seq, _, end), guess in zip(spans, guesses):
                seq.token_ids[end] = guess  # the placeholder at position `end`
                seq.num_draft_cached = end
                if end + 1 < len(seq):  # more placeholders: the guess runs next, to guess the one after
                    following.append((seq, end, end + 1))
            spans = following

    def _catch_up(self, spans: list[tuple[Sequence, int, int]], budget: int) -> list[tuple[Sequence, int, int]]:
        """Runs the spans' heads in forwards of at most `budget` tokens until what is left fits in
        one, and returns what is left (at least each span's last token, whose logits guess). The
        pool was sized for forwards of the target's step; the draft's catch-up may be far longer:
        a long prompt the target chunked, or one the prefix cache served the target but not the draft."""
        while sum(end - start for _, start, end in spans) > budget and any(end - start > 1 for _, start, end in spans):
            head, used, rest = [], 0, []
            for seq, start, end in spans:
                take = max(min(end - start - 1, budget - used), 0)
                if take:
                    head.append((seq, start, start + take))
                    used += take
                    seq.num_draft_cached = start + take
                rest.append((seq, start + take, end))
            self.runner.last_logits(head)  # for the K/V it writes
            spans = rest
        return spans
