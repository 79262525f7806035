"""The paged KV cache's bookkeeping: one pool of fixed-size blocks, a block table per sequence,
and prefix caching of full blocks.

A full block is named by a chained hash, blake2b(parent block's hash + its tokens), so equal
hashes mean equal prefixes; the first block's parent is a hash of the request's cache salt (vLLM's
`cache_salt`), so requests of different salts (tenants) never share a block. The hash is
cryptographic, not Python's hash(): that one is deterministic for ints, so a crafted prompt could
be made to collide with another tenant's prefix. Blocks that fall free keep their contents and
their hash: a later request with the same prefix takes them back instead of recomputing. Free
blocks that hold nothing are handed out first; cached free blocks are evicted least recently used
first. A block is published as soon as a step is scheduled to fill it, before the forward has
computed it (as vLLM does), so that a request admitted later in the same step with the same prefix
(another of a prompt's n choices) shares it rather than computing and holding its own copy: see
Scheduler._publish for why reading it in that same forward is safe.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from kiln.engine.sequence import Sequence

NO_HASH = None
HASH_BYTES = 16  # 128 bits: collisions out of reach, and half the dict key of a 32-byte digest


def first_parent_hash(cache_salt: str | None, lora_id: int = 0) -> bytes:
    """The chain's root: a distinct value per salt, and for no salt at all, and per LoRA adapter
    (0: none), whose K/V differ from the base model's for the same tokens."""
    salt = repr((cache_salt, lora_id)).encode()  # repr: no two pairs read the same
    return hashlib.blake2b(salt, digest_size=HASH_BYTES, person=b"kiln-cache-salt").digest()


def block_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """A full block's key: the parent's digest and the token ids as int32 bytes."""
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=HASH_BYTES).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = NO_HASH
        self.token_ids: tuple[int, ...] = ()  # kept with the hash to rule out collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty_free: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block: dict[bytes, int] = {}
        # Counted in tokens, as vLLM does: tokens looked up and tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty_free) + len(self.cached_free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix caching -------------------------------------------------------------------

    def _block_hash(self, seq: Sequence, index: int) -> bytes:
        """Chained hash of the sequence's full block `index`, memoized on the sequence."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            # The first block's parent is the request's cache salt and adapter: no chain crosses them.
            parent = seq.block_hashes[i - 1] if i else \
                first_parent_hash(seq.params.cache_salt, seq.lora.id if seq.lora else 0)
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size]))
        return seq.block_hashes[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks holding this sequence's leading full blocks, within its reusable
        tokens (Sequence.num_reusable_tokens: never the last token, nor positions whose prompt
        logprobs are still to be computed)."""
        if not self.enable_prefix_caching:
            return []
        matched = []
        for i in range(seq.num_reusable_tokens // self.block_size):
            block_id = self.hash_to_block.get(self._block_hash(seq, i))
            if block_id is None:
                break
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
        return matched

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Publish the sequence's blocks that are full within its first `num_tokens` tokens (by
        default its computed ones), so other requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = (seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        for i in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = self._block_hash(seq, i)
            if block.hash is NO_HASH and h not in self.hash_to_block:
                block.hash = h
                block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.hash_to_block[h] = block.block_id
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their contents are gone: the pool was released). Only
        when no sequence holds a block."""
        assert self.num_free_blocks == self.num_blocks, "reset_prefix_cache with blocks in use"
        for block_id in self.cached_free:
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = NO_HASH, ()
            self.empty_free.append(block_id)
        self.cached_free.clear()
        self.hash_to_block.clear()

    # --- the story of a sequence's blocks ---------------------------------------------------

    def can_allocate(self, prefix: list[int], num_new_tokens: int) -> bool:
        """Can a waiting sequence start with these cached prefix blocks plus `num_new_tokens`?"""
        needed = self.blocks_for(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
        # Reviving a cached free block takes it out of the free pool too.
        revived = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        return needed + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, prefix: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks; new slots come from append_slots."""
        assert not seq.block_table, f"sequence {seq.request_id} already holds blocks"
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(prefix) * self.block_size
        seq.num_published_blocks = len(prefix)
        if seq.admitted:  # back after a preemption: its own blocks are no hit of the prompt's
            return
        seq.admitted = True
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += seq.num_cached_tokens

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room in the sequence's block table for its next `num_new_tokens` tokens."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's claim on its blocks. Leaves go back first, so eviction takes the
        ends of chains before the roots that other prompts are likelier to share."""
        # Blocks published for a step whose forward never finished (Scheduler.abandon) hold nothing.
        for block_id in seq.block_table[seq.num_computed_tokens // self.block_size : seq.num_published_blocks]:
            if self.blocks[block_id].hash is not NO_HASH:
                self._unpublish(self.blocks[block_id])
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is NO_HASH:
                    self.empty_free.append(block_id)
                else:
                    self.cached_free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0

    def _take_free_block(self) -> int:
        if self.empty_free:
            block_id = self.empty_free.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)  # evict the least recently used
            self._unpublish(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _unpublish(self, block: Block) -> None:
        del self.hash_to_block[block.hash]
        block.hash, block.token_ids = NO_HASH, ()
