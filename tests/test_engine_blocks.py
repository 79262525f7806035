"""Block manager and scheduler invariants under random workloads (pure bookkeeping, no model).

A shadow copy of what each KV slot holds is kept beside the block manager: every token a
sequence "computes" is written to its slot, and every sequence must still read its own tokens
back from its blocks after any interleaving of allocate / append / preempt / free. Two owners
of one block, or a prefix-cache hit on the wrong block, would break that."""
from __future__ import annotations

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kiln.engine import block_manager
from kiln.engine.block_manager import BlockManager
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence, SequenceStatus

BLOCK = 4
# Few distinct prompt stems so that prefixes are shared often.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 5, 5], [7] * 14]


class BlockMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, BLOCK, caching)
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.live: list[Sequence] = []  # own blocks
        self.parked: list[Sequence] = []  # preempted, waiting to come back
        self.count = 0

    def _write(self, seq: Sequence, num_tokens: int) -> None:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_tokens):
            self.slots[(seq.block_table[pos // BLOCK], pos % BLOCK)] = seq.token_ids[pos]
        seq.num_computed_tokens += num_tokens
        self.bm.cache_full_blocks(seq)

    def _admit(self, seq: Sequence, write: bool = True) -> int | None:
        """Allocate and publish as the scheduler does, before the K/V are written; the tokens to
        write (`_write`), None when there is no room."""
        prefix = self.bm.match_prefix(seq)
        num_tokens = len(seq) - len(prefix) * BLOCK
        if not self.bm.can_allocate(prefix, num_tokens):
            return None
        free_before, back = self.bm.num_free_blocks, seq.admitted
        cached_before = seq.num_cached_tokens
        self.bm.allocate(seq, prefix)
        self.bm.append_slots(seq, num_tokens)
        self.bm.cache_full_blocks(seq, len(seq))
        assert self.bm.num_free_blocks >= 0 and self.bm.num_free_blocks <= free_before
        assert seq.num_computed_tokens == len(prefix) * BLOCK < len(seq)
        # What the prefix cache saved the prompt, counted at the first admission only.
        assert seq.num_cached_tokens == (cached_before if back else len(prefix) * BLOCK)
        if write:
            self._write(seq, num_tokens)
        self.live.append(seq)
        return num_tokens

    @rule(stem=st.sampled_from(STEMS), length=st.integers(1, 14), tail=st.lists(st.integers(0, 3), max_size=5))
    def start(self, stem: list[int], length: int, tail: list[int]) -> None:
        self.count += 1
        seq = Sequence(str(self.count), (stem + tail)[:length] or [0], SamplingParams(), self.count)
        self._admit(seq)

    @rule(stem=st.sampled_from(STEMS), length=st.integers(1, 14), n=st.integers(2, 3), forward=st.booleans())
    def start_choices(self, stem: list[int], length: int, n: int, forward: bool) -> None:
        """n choices of one prompt admitted in one step, each published before any K/V is written;
        then the step's forward writes them all, or fails and is undone (Scheduler.abandon)."""
        admitted = []
        for _ in range(n):
            self.count += 1
            seq = Sequence(str(self.count), stem[:length], SamplingParams(), self.count)
            num_tokens = self._admit(seq, write=False)
            if num_tokens is None:
                break
            admitted.append((seq, num_tokens))
        for seq, num_tokens in reversed(admitted) if not forward else admitted:
            if forward:
                self._write(seq, num_tokens)
            else:
                self.preempt_seq(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), token=st.integers(0, 3))
    def append(self, index: int, token: int) -> None:
        seq = self.live[index % len(self.live)]
        seq.append_token(token)
        if self.bm.can_append(seq, 1):
            self.bm.append_slots(seq, 1)
            self._write(seq, 1)
        else:
            self.preempt_seq(seq)

    def preempt_seq(self, seq: Sequence) -> None:
        self.live.remove(seq)
        self.bm.deallocate(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.parked.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def preempt(self, index: int) -> None:
        self.preempt_seq(self.live[index % len(self.live)])

    @precondition(lambda self: self.parked)
    @rule()
    def resume(self) -> None:
        if self._admit(self.parked[0]) is not None:
            self.parked.pop(0)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq = self.live.pop(index % len(self.live))
        self.bm.deallocate(seq)

    @invariant()
    def books_balance(self) -> None:
        bm = self.bm
        refs = [0] * bm.num_blocks
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
            assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens)
            for block_id in seq.block_table:
                refs[block_id] += 1
            for pos in range(seq.num_computed_tokens):  # every sequence reads back its own tokens
                assert self.slots[(seq.block_table[pos // BLOCK], pos % BLOCK)] == seq.token_ids[pos]
        assert [b.ref_count for b in bm.blocks] == refs
        free = list(bm.empty_free) + list(bm.cached_free)
        assert len(free) == len(set(free)), "a block twice in the free pool"
        assert sorted(free) == [i for i, r in enumerate(refs) if r == 0], "leaked or double-used block"
        assert all(bm.blocks[b].hash is not None for b in bm.cached_free)
        assert all(bm.blocks[b].hash is None for b in bm.empty_free)
        for h, block_id in bm.hash_to_block.items():
            block = bm.blocks[block_id]
            assert block.hash == h
            assert tuple(self.slots[(block_id, i)] for i in range(BLOCK)) == block.token_ids
        shared = [i for i, r in enumerate(refs) if r > 1]
        assert all(bm.blocks[b].hash is not None for b in shared), "only published full blocks are shared"

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.deallocate(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManager = BlockMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_reuses_blocks_and_counts() -> None:
    bm = BlockManager(8, BLOCK)
    first = Sequence("a", list(range(10)), SamplingParams(), 0)
    bm.allocate(first, bm.match_prefix(first))
    bm.append_slots(first, 10)
    first.num_computed_tokens = 10
    bm.cache_full_blocks(first)
    second = Sequence("b", list(range(9)) + [99, 98], SamplingParams(), 1)
    prefix = bm.match_prefix(second)
    assert prefix == first.block_table[:2]
    bm.allocate(second, prefix)
    assert second.num_cached_tokens == 8
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)
    # Preempted and back: it finds its blocks again, which is no new hit of its prompt's.
    bm.append_slots(second, 3)
    second.num_computed_tokens = 11
    bm.cache_full_blocks(second)
    second.append_token(5)
    bm.deallocate(second)
    bm.allocate(second, bm.match_prefix(second))
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)
    # A prompt that is all full blocks still leaves its last token to compute.
    third = Sequence("c", list(range(8)), SamplingParams(), 2)
    assert bm.match_prefix(third) == first.block_table[:1]


def test_cached_blocks_are_shared_only_within_one_cache_salt() -> None:
    bm = BlockManager(8, BLOCK)
    first = Sequence("a", list(range(10)), SamplingParams(cache_salt="tenant-a"), 0)
    bm.allocate(first, bm.match_prefix(first))
    bm.append_slots(first, 10)
    first.num_computed_tokens = 10
    bm.cache_full_blocks(first)

    def prefix(salt: str | None) -> list[int]:
        return bm.match_prefix(Sequence("b", list(range(10)), SamplingParams(cache_salt=salt), 1))
    assert prefix("tenant-a") == first.block_table[:2]
    assert prefix("tenant-b") == [] and prefix(None) == []


def _published(bm: BlockManager, request_id: str, tokens: list[int], salt: str | None) -> Sequence:
    seq = Sequence(request_id, tokens, SamplingParams(cache_salt=salt), 0)
    bm.allocate(seq, bm.match_prefix(seq))
    bm.append_slots(seq, len(tokens) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq


def test_block_keys_do_not_depend_on_pythons_hash(monkeypatch) -> None:
    """Python's hash() of an int tuple is deterministic, so prompts can be crafted to collide. Here
    every hash() call collides (a stand-in for a crafted collision): two tenants with the same
    prompt still share nothing, and a squatter's colliding block keeps no one's prefix out."""
    monkeypatch.setattr(block_manager, "hash", lambda _value: 0, raising=False)
    bm = BlockManager(16, BLOCK)
    victim = _published(bm, "victim", list(range(10)), "tenant-a")
    keys = {bm.blocks[b].hash for b in victim.block_table[:2]}
    print("keys:", [k.hex() for k in keys])
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == block_manager.HASH_BYTES for k in keys)
    attacker = Sequence("attacker", list(range(10)), SamplingParams(cache_salt="tenant-b"), 1)
    assert bm.match_prefix(attacker) == []
    # The key is a cryptographic function of the salt and the tokens: any change moves it.
    root = block_manager.first_parent_hash("tenant-a")
    assert victim.block_hashes[0] == block_manager.block_hash(root, list(range(BLOCK)))
    assert len({block_manager.first_parent_hash(s) for s in (None, "tenant-a", "tenant-b", "tenant-a:x")}) == 4
    assert block_manager.block_hash(root, [1, 2, 3, 4]) != block_manager.block_hash(root, [1, 2, 3, 5])
    # A squatter publishing first under another salt does not stop the next prompt from caching.
    bm2 = BlockManager(16, BLOCK)
    _published(bm2, "squatter", [7] * 10, "tenant-b")
    owner = _published(bm2, "owner", [7] * 10, "tenant-a")
    assert all(bm2.blocks[b].hash is not None for b in owner.block_table[:2])
    again = Sequence("again", [7] * 10, SamplingParams(cache_salt="tenant-a"), 2)
    assert bm2.match_prefix(again) == owner.block_table[:2]


def test_block_hashing_is_linear_in_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step takes milliseconds; hashing must stay a rounding error: each token is hashed
    once (hashing each block's whole prefix is quadratic), and a memoized hash is not redone."""
    hashed: list[int] = []  # tokens per block_hash call
    real = block_manager.block_hash

    def counting(parent: bytes, tokens) -> bytes:
        hashed.append(len(tokens))
        return real(parent, tokens)

    monkeypatch.setattr(block_manager, "block_hash", counting)
    bm = BlockManager(4096, 16)
    seq = Sequence("long", list(range(32768 + 5)), SamplingParams(cache_salt="t"), 0)  # 2048 full blocks
    last = bm._block_hash(seq, 2047)
    assert hashed == [16] * 2048  # every token of the full blocks once, the partial block never
    assert last == real(seq.block_hashes[2046], list(range(32752, 32768)))  # chained on its parent
    for index in (0, 1000, 2047):  # the same prefix asked again: nothing new is hashed
        assert bm._block_hash(seq, index) == seq.block_hashes[index]
    assert len(hashed) == 2048


def _run_to_completion(scheduler: Scheduler, seqs: list[Sequence], max_tokens: list[int]) -> int:
    """Drive the scheduler with a stand-in for the model whose next token is a function of the
    sequence so far; returns the number of steps."""
    steps = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        steps += 1
        assert steps < 10_000, "scheduler made no progress"
        assert len(batch) <= scheduler.max_num_seqs
        assert sum(batch.num_new_tokens) <= scheduler.max_num_batched_tokens
        assert len({s.request_id for s in batch.seqs}) == len(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status == SequenceStatus.RUNNING and 0 < n <= seq.num_pending_tokens
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
        scheduler.complete_step(batch)
        for seq in batch.seqs:
            if seq.num_pending_tokens == 0:
                seq.append_token(sum(seq.token_ids) % 7)
                if seq.num_output_tokens == max_tokens[int(seq.request_id)]:
                    seq.finish("length")
                    scheduler.finish(seq)
    return steps


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=30), min_size=1, max_size=10),
    outs=st.lists(st.integers(1, 12), min_size=10, max_size=10),
    num_blocks=st.integers(11, 40),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_scheduler_finishes_everything_and_output_is_schedule_independent(
    prompts: list[list[int]], outs: list[int], num_blocks: int, budget: int, max_seqs: int, caching: bool
) -> None:
    # Any one request fits alone (30 + 12 tokens <= 11 blocks of 4), as the engine guarantees.
    bm = BlockManager(num_blocks, BLOCK, caching)
    scheduler = Scheduler(bm, max_seqs, budget)
    seqs = [Sequence(str(i), p, SamplingParams(), i) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    _run_to_completion(scheduler, seqs, outs)
    assert bm.num_free_blocks == num_blocks
    for i, seq in enumerate(seqs):  # same tokens as running it alone, whatever was preempted
        expected = list(prompts[i])
        for _ in range(outs[i]):
            expected.append(sum(expected) % 7)
        assert seq.token_ids == expected


def test_the_newest_running_sequence_gives_way_even_one_scheduled_before_an_older_prefill() -> None:
    """Decodes are scheduled before prefills, so a newer decode held blocks that an older request
    still prefilling (held back by its LoRA adapter's seat) needed: the older one preempted itself
    and ran its 26 prompt tokens again. The newest gives way, whichever group it is in."""
    class Adapter:
        def __init__(self, id_: int) -> None:
            self.id, self.name = id_, f"a{id_}"

    bm = BlockManager(8, 4)
    scheduler = Scheduler(bm, 8, 4, max_loras=1)
    first = Sequence("first", [1] * 3, SamplingParams(max_tokens=2), 0, Adapter(2))
    older = Sequence("older", [2] * 26, SamplingParams(max_tokens=4), 1, Adapter(1))  # waits for a seat
    newer = Sequence("newer", [3] * 3, SamplingParams(max_tokens=28), 2)
    ran = {"first": 0, "older": 0, "newer": 0}
    for seq in (first, older, newer):
        scheduler.add(seq)
    for _ in range(200):  # bounded: far more steps than the three need
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        scheduler.complete_step(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            ran[seq.request_id] += n
            if seq.num_computed_tokens == len(seq):
                seq.append_token(9)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.finish("length")
                    scheduler.finish(seq)
    assert not scheduler.has_unfinished() and bm.num_free_blocks == 8
    assert ran["older"] == 26 + 4 - 1  # its prompt once, then a token a step: never preempted
    assert ran["newer"] > 3 + 28 - 1 and scheduler.num_preemptions >= 1  # the newest gave way


def test_the_newest_decode_without_room_frees_its_blocks_for_an_older_prefill_that_same_step() -> None:
    """The newest running sequence, a decode, had no room and preempted itself, and the step ended
    there: the older prefill behind it (prefills go after decodes) waited a step for nothing."""
    bm = BlockManager(3, 4)
    scheduler = Scheduler(bm, 8, 64)
    older, newer = Sequence("older", list(range(16)), SamplingParams(), 0), Sequence("newer", [1, 2, 3, 4],
                                                                                    SamplingParams(), 1)
    for seq, computed in ((older, 8), (newer, 4)):  # every block held: the decode needs a fourth
        bm.allocate(seq, [])
        bm.append_slots(seq, computed)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    newer.append_token(9)
    batch = scheduler.schedule()
    assert list(scheduler.waiting) == [newer] and scheduler.running == [older]
    assert [s.request_id for s in batch.seqs] == ["older"] and batch.num_new_tokens == [4]  # the freed block


def test_drafts_take_only_what_the_real_tokens_behind_them_leave() -> None:
    """Decodes go first, and their speculative drafts took the whole token budget: a prompt being
    prefilled behind them got one token a step for as long as the decodes ran. And a draft that
    took the last free block left an older prefill no room, so its own decode was preempted."""
    bm = BlockManager(100, 4)
    scheduler = Scheduler(bm, 8, 8)
    decodes = [Sequence(f"d{i}", [1, 2, 3], SamplingParams(), i) for i in (1, 2)]
    for seq in decodes:
        scheduler.add(seq)
    scheduler.complete_step(scheduler.schedule())
    prompt = Sequence("prompt", list(range(20)), SamplingParams(), 0)  # the oldest, chunked behind them
    scheduler.waiting.appendleft(prompt)
    for seq in decodes:
        seq.append_token(9)
    scheduler.complete_step(scheduler.schedule())  # the prompt's first 6 tokens, a token each decode
    for step in range(3):
        for seq in decodes:
            seq.append_token(9)
            seq.add_drafts([7, 7, 7, 7])
        batch = scheduler.schedule()
        ran = dict(zip((s.request_id for s in batch.seqs), batch.num_new_tokens))
        assert ran["prompt"] == min(6, 20 - prompt.num_computed_tokens), (step, ran)  # 8 less one per decode
        assert sum(ran.values()) <= 8
        for seq in decodes:  # every guess rejected: the decode ran its one real token
            seq.drop_drafts()
        batch.num_new_tokens = [1 if s in decodes else n for s, n in zip(batch.seqs, batch.num_new_tokens)]
        scheduler.complete_step(batch)

    bm = BlockManager(4, 4)  # one block free: the older prefill's next chunk needs it
    scheduler = Scheduler(bm, 8, 64)
    older, newer = Sequence("older", list(range(16)), SamplingParams(), 0), Sequence("newer", [1, 2, 3],
                                                                                    SamplingParams(), 1)
    for seq, computed in ((older, 8), (newer, 2)):
        bm.allocate(seq, [])
        bm.append_slots(seq, computed)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    newer.add_drafts([7, 7, 7])
    batch = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and [s.request_id for s in batch.seqs] == ["newer", "older"]
    assert batch.num_new_tokens == [2, 4]  # one guess fits the decode's own block; the free one is the prefill's


def test_choices_admitted_in_one_step_share_their_prompt_blocks() -> None:
    """n choices of one prompt (n requests of one prompt, as the server makes them) admitted in one
    step: blocks were published only once the forward had computed them, so each choice computed
    and held its own copy of the prompt. Now the first choice's full blocks are published as it is
    scheduled, and the others take them: one copy, plus each choice's own last block."""
    prompt, outs = list(range(10)), [3, 4, 5]  # two full blocks of 4, and 2 tokens in a third
    bm = BlockManager(32, BLOCK)
    scheduler = Scheduler(bm, 8, 64)
    seqs = [Sequence(str(i), prompt, SamplingParams(), i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == seqs and batch.num_new_tokens == [10, 2, 2]
    assert [s.num_cached_tokens for s in seqs] == [0, 8, 8]
    assert all(s.block_table[:2] == seqs[0].block_table[:2] for s in seqs)
    assert bm.num_blocks - bm.num_free_blocks == 3 + 1 + 1  # not 3 x 3
    _run_to_completion(scheduler, seqs, outs)
    assert bm.num_free_blocks == bm.num_blocks
    for seq, out in zip(seqs, outs):  # the tokens each makes alone
        expected = list(prompt)
        for _ in range(out):
            expected.append(sum(expected) % 7)
        assert seq.token_ids == expected

    # A prompt longer than the step: the choices behind it are admitted with its last chunk, and
    # take that chunk's full block too.
    bm = BlockManager(32, BLOCK)
    scheduler = Scheduler(bm, 8, 10)
    seqs = [Sequence(str(i), list(range(14)), SamplingParams(), i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.complete_step(scheduler.schedule())  # the first choice's first 10 tokens
    batch = scheduler.schedule()
    assert batch.seqs == seqs and batch.num_new_tokens == [4, 2, 2]
    assert [s.num_cached_tokens for s in seqs] == [0, 12, 12]
    assert bm.num_blocks - bm.num_free_blocks == 4 + 1 + 1


def test_an_interrupt_inside_schedule_leaves_nothing_published_or_held(monkeypatch) -> None:
    """A Ctrl-C in LLM.generate that lands inside schedule(), after a request was admitted: it was
    in neither the waiting nor the running list, so the abort that follows freed nothing, and its
    blocks, published for a forward that never ran, were matched by the next such prompt as if
    computed."""
    bm = BlockManager(16, BLOCK)
    scheduler = Scheduler(bm, 8, 64)
    seqs = [Sequence(str(i), list(range(12)), SamplingParams(), i) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    match, calls = bm.match_prefix, []

    def interrupted(seq: Sequence) -> list[int]:
        calls.append(seq)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return match(seq)
    monkeypatch.setattr(bm, "match_prefix", interrupted)
    try:
        scheduler.schedule()
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(bm, "match_prefix", match)
    for seq in seqs:  # LLM.generate's abort of what it started
        seq.finish("abort")
        scheduler.finish(seq)
    assert bm.num_free_blocks == bm.num_blocks and not bm.hash_to_block
    again = Sequence("again", list(range(13)), SamplingParams(), 2)
    scheduler.add(again)
    assert scheduler.schedule().num_new_tokens == [13]  # computed afresh


def test_an_interrupt_after_a_preemption_leaves_the_victim_in_no_list(monkeypatch) -> None:
    """A Ctrl-C inside schedule() after it preempted a sequence (back in waiting, still in the old
    running list): the abort must take it out of both, or it runs again, finished, next step."""
    bm = BlockManager(2, BLOCK)
    scheduler = Scheduler(bm, 8, 64)
    old, new = (Sequence(str(i), list(range(BLOCK)), SamplingParams(), i) for i in range(2))
    for seq in (old, new):
        scheduler.add(seq)
    scheduler.complete_step(scheduler.schedule())  # both prompts, a block each: the pool is full
    for seq in (old, new):
        seq.append_token(1)

    def interrupted(seq: Sequence, num_tokens: int) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(scheduler, "_publish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scheduler.schedule()  # old's decode needs a block: new gives way, then the interrupt
    assert new in scheduler.waiting and new in scheduler.running
    for seq in (old, new):  # LLM.generate's abort of what it started
        seq.finish("abort")
        scheduler.finish(seq)
    assert not scheduler.waiting and not scheduler.running
    assert bm.num_free_blocks == bm.num_blocks


def test_drafts_are_not_published_before_they_are_checked() -> None:
    bm = BlockManager(8, BLOCK)
    scheduler = Scheduler(bm, 8, 64)
    seq = Sequence("s", [1, 2, 3], SamplingParams(), 0)
    scheduler.add(seq)
    scheduler.complete_step(scheduler.schedule())
    seq.append_token(4)
    seq.add_drafts([7, 7, 7, 7])  # the second block, all guesses
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [5]
    assert set(bm.hash_to_block.values()) == {seq.block_table[0]}  # [1, 2, 3, 4] only
    seq.drop_drafts()  # every guess rejected
    batch.num_new_tokens = [1]
    scheduler.complete_step(batch)
    assert set(bm.hash_to_block.values()) == {seq.block_table[0]}
