"""Continuous batching: each step picks which sequences run and how many tokens each.

A step is bounded by max_num_seqs and by a token budget (max_num_batched_tokens). Running
decodes go first (one token each, they keep latency low), then running prefills continue in
chunks, then waiting requests are admitted first come, first served into what budget is left.
When the KV pool runs dry, the most recently arrived running sequence is preempted by
recompute: its blocks are freed and it goes back to the head of the queue with all its tokens,
so nothing it produced is lost (its full blocks usually come back from the prefix cache).
At most max_loras distinct LoRA adapters run at once. A request whose adapter finds no seat waits,
and so do the adapter requests behind it (so it is not starved); base-model requests go on.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.engine.block_manager import BlockManager
from kiln.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence runs this step

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)

    def remove(self, seq: Sequence) -> int:
        """Take a sequence back out; returns the tokens it was to run."""
        i = self.seqs.index(seq)
        del self.seqs[i]
        return self.num_new_tokens.pop(i)

    def __len__(self) -> int:
        return len(self.seqs)


def _needed(seq: Sequence) -> int:
    """The tokens a running sequence must run to make progress: its pending ones but drafts."""
    return seq.num_pending_tokens - seq.num_draft_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 1):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras  # distinct LoRA adapters among the running sequences
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # Decodes first, then unfinished prefills; each group first come, first served.
        queue = deque(sorted(self.running, key=lambda s: (_needed(s) > 1, s.arrival)))
        kept: list[Sequence] = []
        preempted = False
        while queue and budget > 0:
            seq = queue.popleft()
            needed = _needed(seq)
            num_tokens = self._fit(seq, min(needed, budget))
            while num_tokens == 0:
                # The newest running sequence gives way, scheduled already this step or not (a newer
                # decode goes before an older prefill), as long as it is newer than this one.
                victim = max((s for s in (*queue, *kept) if s.arrival > seq.arrival), key=lambda s: s.arrival,
                             default=None)
                if victim is None:
                    break
                if victim in queue:
                    queue.remove(victim)
                else:
                    budget += batch.remove(victim)
                    kept.remove(victim)
                self._preempt(victim)
                preempted = True
                num_tokens = self._fit(seq, min(needed, budget))
            if num_tokens == 0:
                # The newest without room steps aside; the older ones behind it (prefills, as decodes
                # go first) run on the blocks it frees this very step.
                self._preempt(seq)
                preempted = True
                continue
            if seq.num_draft_tokens:
                # Guesses take only the budget that the real tokens of the running sequences behind
                # (decodes, prompt chunks) and one of the queue's head leave, and keep a block for
                # each of them: they must not stall another request, nor preempt one.
                others = len(queue) + bool(self.waiting)
                real = sum(_needed(s) for s in queue) + bool(self.waiting)
                drafts = min(seq.num_draft_tokens, budget - real - num_tokens)
                num_tokens = max(num_tokens, self._fit(seq, num_tokens + drafts, keep_blocks=others))
            seq.drop_drafts(seq.num_pending_tokens - num_tokens)  # drafts that do not fit wait for no step
            self.block_manager.append_slots(seq, num_tokens)
            batch.add(seq, num_tokens)
            kept.append(seq)
            budget -= num_tokens
        kept.extend(queue)  # not scheduled this step (budget spent), still running
        for seq, num_tokens in zip(batch.seqs, batch.num_new_tokens):
            self._publish(seq, num_tokens)  # e.g. a prompt's last chunk, for its other choices admitted below

        # Admitting while preempting would only thrash.
        adapters = {seq.lora for seq in kept if seq.lora is not None}
        held, i = False, 0  # once a request waits for an adapter seat, later ones with adapters wait too
        while i < len(self.waiting) and budget > 0 and not preempted and len(kept) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.lora is not None and (held or (seq.lora not in adapters and len(adapters) >= self.max_loras)):
                held, i = True, i + 1
                continue
            prefix = self.block_manager.match_prefix(seq)
            num_tokens = min(len(seq) - len(prefix) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(prefix, num_tokens):
                break  # FCFS: nobody overtakes for memory
            del self.waiting[i]
            self.block_manager.allocate(seq, prefix)
            self.block_manager.append_slots(seq, num_tokens)
            self._publish(seq, num_tokens)  # before the next waiting request looks up its prefix
            seq.status = SequenceStatus.RUNNING
            if seq.lora is not None:
                adapters.add(seq.lora)
            batch.add(seq, num_tokens)
            kept.append(seq)
            budget -= num_tokens
        self.running = sorted(kept, key=lambda s: s.arrival)
        return batch

    def _fit(self, seq: Sequence, num_tokens: int, keep_blocks: int = 0) -> int:
        """How many of `num_tokens` fit into the sequence's blocks plus the free pool (less
        `keep_blocks` kept for others)."""
        bm = self.block_manager
        free = max(bm.num_free_blocks - keep_blocks, 0)
        room = (len(seq.block_table) + free) * bm.block_size - seq.num_computed_tokens
        return max(0, min(num_tokens, room))

    def _publish(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the prefix cache the blocks this step's `num_tokens` fill, before the forward has
        computed them: a request admitted after this one in the same step (another of its prompt's
        n choices) then shares them instead of computing and holding a copy. It reads them in that
        same forward, which is safe: each layer stores the whole batch's K/V before any row attends,
        nothing leaves the batch after this (victims of preemption are all out before), and a forward
        that fails is undone (abandon). Drafts are left out: the check may yet reject them."""
        end = min(seq.num_computed_tokens + num_tokens, len(seq) - seq.num_draft_tokens)
        self.block_manager.cache_full_blocks(seq, end)

    def _preempt(self, seq: Sequence) -> None:
        seq.drop_drafts()  # unchecked guesses: not worth recomputing
        seq.num_draft_cached = 0  # a draft model's K/V go with the blocks
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def complete_step(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens now have their K/V in the cache."""
        for seq, num_tokens in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_tokens
            self.block_manager.cache_full_blocks(seq)  # what accepted drafts filled (left out by _publish)

    def abandon(self, batch: ScheduledBatch) -> None:
        """Undo a step whose forward did not finish (an error; Ctrl-C in LLM.generate): the blocks
        published for it hold nothing, and a sequence admitted onto them counts them as computed.
        So its sequences go back to the queue, to be recomputed from what their blocks really hold."""
        for seq in sorted(batch.seqs, key=lambda s: s.arrival, reverse=True):  # the oldest ends up first
            self.running.remove(seq)
            self._preempt(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence, wherever it is: also one an interrupt caught
        inside schedule(), admitted (its blocks allocated and published) but in neither list yet,
        or preempted (back in waiting) but not yet out of running."""
        if seq in self.waiting:  # a victim preempted before the interrupt may be in both lists
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.block_table:  # a waiting sequence holds none
            self.block_manager.deallocate(seq)
