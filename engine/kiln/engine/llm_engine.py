"""The engine loop: requests in, one scheduled forward per step(), tokens and text out.

LLMEngine is the step-at-a-time API the server drives; LLM (kiln.engine.llm) is the offline
convenience that submits a list of prompts and steps until all are done."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from kiln.engine.block_manager import BlockManager
from kiln.engine.config import Config, resolve_max_model_len
from kiln.engine.draft_model import DraftModel
from kiln.engine.loader import load_model
from kiln.engine.lora import LoRAAdapter, LoRANotLoadedError, load_adapter
from kiln.engine.lora_cache import LoRACache
from kiln.engine.model_runner import ModelRunner, RunnerOutput
from kiln.engine.prompt_logprobs import PromptLogprob, entry
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import ScheduledBatch, Scheduler
from kiln.engine.sequence import Sequence
from kiln.engine.speculative import may_speculate, propose
from kiln.engine.structured_output import Grammars
from kiln.engine.tokenizer import IncrementalDetokenizer


class RequestOutput:
    """A request's state after a step. new_token_ids and new_text are this step's. The cumulative
    fields (prompt_token_ids, token_ids, text, logprobs: all so far) are read from the sequence's
    lists and text, cut at this step's lengths, only when asked: a step copies nothing that grows with
    the request (copied every step, they made a request cost O(length^2)). The lists only ever change
    past an output's lengths (appends, and speculative drafts replaced), so the cut is stable."""

    def __init__(self, seq: Sequence, new_token_ids: list[int], new_text: str, visible_chars: int) -> None:
        self.request_id = seq.request_id
        self.new_token_ids = new_token_ids
        self.new_text = new_text
        # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), all
        # of them from a request's first output on (kiln.engine.prompt_logprobs); never changed again.
        self.prompt_logprobs: list[PromptLogprob | None] | None = seq.prompt_logprobs
        self.finished = seq.is_finished
        self.finish_reason = seq.finish_reason  # "stop" | "length" | "abort" | "error" | None
        self.error = seq.error  # with "error": what went wrong; the text so far is not a whole answer
        self.stop_reason = seq.stop_reason  # with "stop": the stop string or stop token id, None for EOS
        self.num_cached_tokens = seq.num_cached_tokens
        # The text is cut from the sequence's when asked, not kept: a string per step, each a copy of
        # all the text so far, made a stalled streaming client's queued outputs O(length^2) in
        # memory. (The text only grows, and a stop string is cut off past what was made visible.)
        self._seq, self._num_tokens, self._visible = seq, len(seq), visible_chars
        self._num_logprobs = None if seq.logprobs is None else len(seq.logprobs)

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        return self._seq.token_ids[:self._seq.num_prompt_tokens]

    @cached_property
    def token_ids(self) -> list[int]:
        return self._seq.token_ids[self._seq.num_prompt_tokens:self._num_tokens]

    @cached_property
    def text(self) -> str:
        return self._seq.text[:self._visible]

    @cached_property
    def logprobs(self) -> list[dict[str, Any]] | None:
        return None if self._num_logprobs is None else self._seq.logprobs[:self._num_logprobs]

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float  # 0..1
    num_kv_blocks: int  # the pool's size
    num_free_kv_blocks: int  # of them, held by no sequence (empty, or cached for a prefix): all when idle
    kv_cache_bytes: int  # allocated now: 0 asleep, or after a fatal error
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    is_sleeping: bool
    spec_decode_num_draft_tokens: int = 0  # speculative guesses checked by the model, since start
    spec_decode_num_accepted_tokens: int = 0  # of them, those it agreed with
    # With LoRA enabled (else None): the adapters of the running and of the waiting requests, and
    # how many may run at once
    lora_adapters: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    max_loras: int | None = None


class LLMEngine:
    def __init__(self, config: Config):
        if config.tensor_parallel_size > 1:  # a shape the ranks cannot split, said before any weight is read
            from kiln.engine.tensor_parallel import check_before_load
            check_before_load(config.model, config.tensor_parallel_size)
        loaded = load_model(config)
        self.model_config = loaded.model_config
        self.tokenizer = loaded.tokenizer if config.chat_template is None else \
            loaded.tokenizer.with_chat_template(config.chat_template)
        self.grammars = Grammars(self.tokenizer, loaded.model_config.vocab_size)
        self.config = replace(config, max_model_len=resolve_max_model_len(config, loaded.model_config))
        self.model = loaded.model  # whole (a tensor-parallel rank 0 runs its slice): adapters are read against it
        # LoRA adapters by the name requests use, at most lora_capacity of them loaded (the runner
        # and the requests are made below: looked up when called)
        self.loras = LoRACache(self.config.lora_capacity, self._load_lora, lambda a: self.runner.remove_lora(a),
                               lambda: (seq.lora for seq in self.requests.values()))
        # These, and a draft model, are loaded before the pool is sized: on a GPU their weights
        # come off the free memory (adapters loaded later come out of what the pool leaves). Each
        # is read (one that cannot load stops the start); those past the capacity load when named.
        first: dict[str, LoRAAdapter] = {}
        for name, path in self.config.lora_modules:
            self._check_lora_name(name)
            adapter = load_adapter(name, path, self.model, self.config.max_lora_rank)
            self.loras.paths[name] = path
            if len(first) < self.loras.capacity:
                first[name] = adapter
        speculative = self.config.speculative
        self.drafter = DraftModel(self.config, loaded.model_config) \
            if speculative is not None and speculative.method == "draft_model" else None
        draft_block_bytes = self.drafter.block_bytes if self.drafter else 0
        if self.config.tensor_parallel_size == 1:
            self.runner = ModelRunner(self.config, loaded.model, loaded.model_config, draft_block_bytes)
        else:  # rank 0 of N: spawns the other ranks, which run the forward only
            from kiln.engine.tp_ranks import start_tensor_parallel
            self.runner = start_tensor_parallel(self.config, loaded, draft_block_bytes)
        try:
            self.loras.loaded = {name: self.runner.add_lora(adapter) for name, adapter in first.items()}
            if self.drafter:  # whole, on rank 0
                self.drafter.allocate(self.runner.num_blocks)
            pool_tokens = self.runner.num_blocks * self.config.block_size
            if pool_tokens < self.config.max_model_len:
                # Otherwise one long request could never fit, even alone, and would wait forever.
                raise ValueError(
                    f"the KV cache holds {pool_tokens} tokens (kv_cache_memory={self.config.kv_cache_memory}), "
                    f"less than max_model_len={self.config.max_model_len}; raise kv_cache_memory or lower "
                    "max_model_len"
                )
        except BaseException:
            # A tensor-parallel engine that fails to start stops its ranks: left running, they would hold
            # this process's torch.distributed group and refuse the next engine until the process exits.
            self.runner.close()
            raise
        self._new_scheduler()
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.is_sleeping = False
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding, since start

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any: a process runs one such engine at a time."""
        self.runner.close()

    def add_lora(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Load a PEFT LoRA folder that requests may name from now on (config.enable_lora). With
        replace, one already loaded under that name is unloaded once the new one has loaded.
        LoRACapacityError when lora_capacity adapters are loaded and requests hold them all."""
        self._check_lora_name(name, replace)
        return self.loras.add(name, path)

    def _check_lora_name(self, name: str, replace: bool = False) -> None:
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need enable_lora (--enable-lora)")
        if not isinstance(name, str) or not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self.loras.paths and not replace:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (load_inplace replaces it)")

    def _load_lora(self, name: str, path: str) -> LoRAAdapter:
        return self.runner.add_lora(load_adapter(name, path, self.model, self.config.max_lora_rank))

    def remove_lora(self, name: str) -> int:
        """Unload an adapter (KeyError if none has that name): no request may name it from now on,
        and those that already do finish with it first, its weights going with the last of them
        (refusing while any ran, as before, never succeeded under steady traffic). Returns how
        many requests still use it."""
        return self.loras.remove(name)

    def _new_scheduler(self) -> None:
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.max_loras)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora: str | None = None) -> None:
        """lora: the name of a loaded LoRA adapter to run the request with (add_lora); one unloaded
        for room is read again (LoRACapacityError if requests hold every loaded one)."""
        params = params or SamplingParams()
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora is not None and lora not in self.loras.paths:
            raise LoRANotLoadedError(f"no LoRA adapter named {lora!r} is loaded")
        token_ids = self._tokenize(prompt)
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.config.max_model_len - len(token_ids))
        vocab = self.model_config.vocab_size
        if params.logit_bias and not all(t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got "
                             f"{sorted(t for t in params.logit_bias if t >= vocab)[:5]}")
        seq = Sequence(request_id, token_ids, params, next(self._arrivals),
                       None if lora is None else self.loras.get(lora))
        if params.seed is not None:
            seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed)
        if not params.ignore_eos:
            seq.stop_token_ids |= frozenset(self.tokenizer.eos_token_ids)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids=token_ids)
        if params.structured_outputs is not None:
            seq.matcher = self.grammars.matcher(params.structured_outputs)
        if self.is_sleeping:  # a request wakes a sleeping engine: it is never refused for sleeping
            self.wake_up()
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def sleep(self) -> None:
        """Release the KV cache while idle (a standby replica), as vLLM's sleep mode level 1
        does; the weights stay. ValueError while requests run. The prefix cache is forgotten."""
        if self.has_unfinished_requests():
            raise ValueError(f"{len(self.requests)} request(s) in flight; sleep once they finish")
        if not self.is_sleeping:
            for runner in self._runners():
                runner.release_kv_cache()
            self.block_manager.reset_prefix_cache()
            self.is_sleeping = True

    def wake_up(self) -> None:
        """Allocate the KV cache again (same size), ready to serve."""
        if self.is_sleeping:
            for runner in self._runners():
                runner.allocate_kv_cache()
            self.is_sleeping = False

    def _kv_cache_bytes(self) -> int:
        """Every pool of the engine: under tensor parallelism each rank holds a pool like rank 0's
        (the same blocks, its own heads), which counted alone said 1/N of what the pod holds."""
        def held(runner: Any) -> int:
            return sum(t.nbytes for t in (runner.kv_cache, runner.kv_scales) if t is not None)
        return held(self.runner) * self.config.tensor_parallel_size + (held(self.drafter.runner) if self.drafter else 0)

    def _runners(self) -> list:
        """The target's runner, and the draft model's if there is one (each owns a KV pool)."""
        return [self.runner] + ([self.drafter.runner] if self.drafter else [])

    def discard(self) -> None:
        """After a fatal error in step(): forget every request and release the KV cache. The
        bookkeeping may be inconsistent, so it is rebuilt empty rather than unwound; this engine
        is not stepped again (its server reports itself dead and is restarted)."""
        self.requests.clear()
        self._new_scheduler()
        for runner in self._runners():
            runner.release_kv_cache()

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
            bad = [t for t in token_ids if t >= vocab]
            if bad:  # an embedding lookup out of range: an IndexError from torch
                raise ValueError(f"the tokenizer gave token ids {bad[:5]} that the model does not have "
                                 f"(its vocab_size is {vocab}): the tokenizer does not belong to this model")
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, the context length (max_model_len) is "
                f"{self.config.max_model_len}: no room left to generate"
            )
        return token_ids

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            seq.finish("abort")
            self.scheduler.finish(seq)
            self.loras.retire()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def running_request_ids(self) -> list[str]:
        """Requests the scheduler has taken into the batch (no longer waiting to start)."""
        return [seq.request_id for seq in self.scheduler.running]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_cache_usage=bm.usage(),
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            kv_cache_bytes=self._kv_cache_bytes(),
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            is_sleeping=self.is_sleeping,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            lora_adapters=tuple(tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))
                                for seqs in (self.scheduler.running, self.scheduler.waiting))
            if self.config.enable_lora else None,
            max_loras=self.config.max_loras if self.config.enable_lora else None,
        )

    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch; outputs for the requests that got a token."""
        if self.config.speculative is not None:
            self._add_drafts()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            if self.drafter is not None:
                self.drafter.fill(batch.seqs)
            self._constrain_drafts(batch)
            ran = self.runner.run(batch)
            emitted = self._check_drafts(batch, ran)
        except BaseException:
            self.scheduler.abandon(batch)  # the step's blocks were published before its forward
            raise
        self.scheduler.complete_step(batch)
        for seq, scored in ran.prompt_logprobs:
            seq.prompt_logprobs += [entry(position, self.tokenizer.decode_token) for position in scored]
        outputs = []
        for seq, tokens in emitted:
            seq.drop_drafts()  # the accepted ones come back as tokens, each checked for a stop
            for token, logprob in tokens:
                seq.append_token(token)
                if logprob is not None:
                    seq.logprobs.append(logprob)
                self._check_stop(seq, token)
                if seq.is_finished:
                    break
            outputs.append(self._output(seq))
            if seq.is_finished:
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
        self.loras.retire()
        return outputs

    def _add_drafts(self) -> None:
        """Guess the next tokens of the decoding sequences that may speculate (n-gram lookup, or
        placeholders for the draft model), leaving room for the model's own token within
        max_tokens and the context."""
        limit = self.config.speculative.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        for seq in self.scheduler.running:
            if may_speculate(seq):
                room = min(seq.params.max_tokens - seq.num_output_tokens, self.config.max_model_len - len(seq)) - 1
                if self.drafter is None:
                    seq.add_drafts(propose(seq.token_ids, self.config.speculative, room))
                else:  # placeholders, guessed once scheduled (DraftModel.fill)
                    seq.add_drafts([seq.token_ids[-1]] * min(room, self.config.speculative.num_speculative_tokens))

    def _constrain_drafts(self, batch: ScheduledBatch) -> None:
        """A constrained sequence checks only the drafts its structured output allows."""
        for i, seq in enumerate(batch.seqs):
            if seq.matcher is not None and seq.num_draft_tokens:
                refused = seq.num_draft_tokens - seq.matcher.validate_tokens(seq.draft_token_ids)
                seq.drop_drafts(refused)
                batch.num_new_tokens[i] -= refused

    def _check_drafts(self, batch: ScheduledBatch, ran: RunnerOutput) -> list[tuple[Sequence, list[tuple]]]:
        """Per sampled sequence its new (token, logprob)s: the drafts the model agreed with, in
        order, then the model's own token. The rejected drafts leave the sequence and the batch's
        count, so the step records K/V only for tokens that stay (their blocks may be shared)."""
        if self.config.speculative is None:  # no drafts, nothing to check: a token per sequence
            return [(seq, [entry]) for seq, entry in zip(ran.sampled, zip(ran.tokens, ran.logprobs))]
        index = {id(seq): i for i, seq in enumerate(batch.seqs)}
        emitted, row = [], 0
        while row < len(ran.sampled):
            seq = ran.sampled[row]
            drafts = seq.draft_token_ids
            tokens = list(zip(ran.tokens[row:row + len(drafts) + 1], ran.logprobs[row:row + len(drafts) + 1]))
            row += len(drafts) + 1
            accepted = next((i for i, draft in enumerate(drafts) if tokens[i][0] != draft), len(drafts))
            seq.drop_drafts(len(drafts) - accepted)
            batch.num_new_tokens[index[id(seq)]] -= len(drafts) - accepted
            seq.num_draft_cached = min(seq.num_draft_cached, len(seq))  # a draft model's K/V of kept tokens
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            emitted.append((seq, tokens[:accepted + 1]))
        return emitted

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
            if seq.matcher.is_error():  # e.g. llguidance's lexer limit, met only as the output grows:
                # its mask then lets only EOS through, which must not pass for a complete answer
                seq.error = f"structured outputs: the constraint failed while generating: " \
                            f"{seq.matcher.get_error().strip()}"
                seq.finish("error")
                return
        # A constrained row draws a stop token before min_tokens only when its grammar allows
        # nothing else (Sampler._without_stops): the answer is complete.
        if token in seq.stop_token_ids and (seq.may_stop or seq.matcher is not None):
            if params.include_stop_str_in_output:  # its text, if it has any once decoded
                seq.text += seq.detokenizer.add([token])
            seq.text += seq.detokenizer.flush()  # a character left unfinished comes out as U+FFFD
            eos = not params.ignore_eos and token in self.tokenizer.eos_token_ids  # EOS first, as vLLM
            seq.stop_reason = None if eos or token not in (params.stop_token_ids or ()) else token
            seq.finish("stop")
            return
        old_len = len(seq.text)
        seq.text += seq.detokenizer.add([token])
        at_limit = seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len
        if at_limit:
            seq.text += seq.detokenizer.flush()
        if params.stop and seq.num_output_tokens > params.min_tokens and len(seq.text) > old_len:
            # Past min_tokens, as vLLM checks stop strings (a stop string in token min_tokens left an
            # answer one token short, or empty at min_tokens 1, where EOS could not end it).
            # Only a stop string ending in the new text can be new; it may start a little before it.
            # (Each string from its own start: a short one wholly in the old text came before
            # min_tokens let it stop the request, and must not stop it now.)
            hits = [(i, s) for i, s in ((seq.text.find(s, max(0, old_len - len(s) + 1)), s) for s in params.stop)
                    if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s) if params.include_stop_str_in_output else i]
                seq.stop_reason = s
                seq.finish("stop")
                return
        if seq.matcher is not None and seq.matcher.is_stopped():  # complete: nothing may follow
            seq.text += seq.detokenizer.flush()
            seq.finish("stop")
            return
        if at_limit:
            seq.finish("length")

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        # While running, hold back text that might still turn out to begin a stop string.
        # (Not when the stop string is to be sent too: what comes before it is sent either way.)
        params = seq.params
        holdback = 0 if seq.is_finished or not params.stop or params.include_stop_str_in_output \
            else max(len(s) for s in params.stop) - 1
        visible = max(seq.num_emitted_chars, len(seq.text) - holdback)
        new_text = seq.text[seq.num_emitted_chars : visible]
        new_token_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]
        seq.num_emitted_chars, seq.num_emitted_tokens = visible, seq.num_output_tokens
        return RequestOutput(seq, new_token_ids, new_text, visible)
