"""Paged KV-cache bookkeeping: physical block ids, ref counts, free list, prefix cache.

The scheduler asks it whether a sequence fits (`can_allocate` / `can_append`) and then mutates
`seq.block_table` through it (`allocate` / `append_slots` / `free`). No tensors live here: the
model runner owns the KV tensor and only reads block tables. Full blocks whose K/V are computed
are registered under a chained hash key (parent hash, token ids) so later prompts with the same
prefix reuse them; freed cached blocks stay reusable until evicted in LRU order. A sequence on
a LoRA adapter starts its chain from the adapter (name, id, path), so adapters never share K/V.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from serving.engine.sequence import Sequence

# A prefix-cache key: (hash of the chained parent key or None for the first block, block's ids).
# The dict compares keys by equality, so the token ids of the block itself are compared and a
# hash collision can never hand out a block with different tokens.
BlockKey = tuple[int | None, tuple[int, ...]]


@dataclass(slots=True)
class Block:
    """One physical KV block."""

    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set while the block is registered in the prefix cache


class BlockManager:
    """Allocates fixed-size KV blocks to sequences, with automatic prefix caching.

    Free blocks are kept in two ordered pools: `free_block_ids` (no cached content, FIFO)
    and `evictable_block_ids` (cached content, ref count 0, least recently freed first).
    New blocks come from `free_block_ids` first, then by evicting the LRU cached block, so
    cached prefixes live as long as possible. A sample of an `n > 1` request shares its
    leader's full prompt blocks (via the prefix cache, or via `donor` when caching is off).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[BlockKey, int] = {}  # key -> block id
        self._seq_keys: dict[int, list[BlockKey]] = {}  # seq_id -> keys of its full blocks
        # seq_id -> how many leading full blocks cache_computed_blocks already looked at; it runs
        # for every running sequence every step, so it must not rescan (and rehash) old blocks.
        self._num_registered: dict[int, int] = {}
        self.num_prefix_queries = 0  # tokens looked up at admission (for the hit rate)
        self.num_prefix_hits = 0  # of those, tokens served from the cache

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (never-used/uncached plus evictable cached ones)."""
        return len(self.free_block_ids) + len(self.evictable_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _keys(self, seq: Sequence, num_full_blocks: int) -> list[BlockKey]:
        """Chained keys of the first `num_full_blocks` full blocks of `seq` (memoized)."""
        keys = self._seq_keys.setdefault(seq.seq_id, [])
        bs = self.block_size
        lora = seq.lora_request
        root = None if lora is None else hash(("lora", lora.lora_name, lora.lora_int_id, lora.lora_path))
        while len(keys) < num_full_blocks:
            i = len(keys)
            parent = hash(keys[-1]) if keys else root
            keys.append((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return keys

    def _prefix_hits(self, seq: Sequence, donor: Sequence | None = None) -> list[int]:
        """Block ids that already hold K/V for a prefix of `seq` (no side effects).

        NOTE: at least the last token is always left to compute, since its logits are needed;
        so only blocks lying entirely within the first `num_tokens - 1` tokens can be hits. A
        prompt whose logprobs are asked for (echo, decoder_input_details) is computed whole.
        """
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if self.enable_prefix_caching:
            hits = []
            for key in self._keys(seq, max_blocks)[:max_blocks]:
                block_id = self.cached.get(key)
                if block_id is None:
                    break
                hits.append(block_id)
            return hits
        if donor is None or donor.block_table == []:
            return []
        # Without the cache, share the donor's computed full blocks over the common prefix.
        n = min(max_blocks, donor.num_computed_tokens // self.block_size, len(donor.block_table))
        bs = self.block_size
        while n > 0 and donor.token_ids[: n * bs] != seq.token_ids[: n * bs]:
            n -= 1
        return donor.block_table[:n]

    def num_cached_tokens(self, seq: Sequence, donor: Sequence | None = None) -> int:
        """Prefix tokens of a waiting `seq` whose K/V could be reused right now."""
        return len(self._prefix_hits(seq, donor)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int, donor: Sequence | None = None) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed."""
        hits = self._prefix_hits(seq, donor)
        num_needed = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        # Hit blocks that sit in the evictable pool cannot also serve as fresh blocks.
        num_hits_evictable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_needed <= self.num_free_blocks - num_hits_evictable

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running `seq` can get slots for `num_new_tokens` more tokens."""
        num_needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return num_needed <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable_block_ids.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            assert block.key is not None and self.cached.get(block.key) == block_id
            del self.cached[block.key]
            block.key = None
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int, donor: Sequence | None = None) -> int:
        """Give a waiting `seq` its cached prefix blocks plus fresh ones for `num_new_tokens`.

        Returns:
            The number of prompt tokens served from the cache (the caller sets
            `seq.num_computed_tokens` to it).
        """
        assert not seq.block_table, f"seq {seq.seq_id} already has blocks"
        assert self.can_allocate(seq, num_new_tokens, donor)
        hits = self._prefix_hits(seq, donor)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable_block_ids[block_id]
            block.ref_count += 1
        num_cached = len(hits) * self.block_size
        seq.block_table = list(hits)
        for _ in range(self.blocks_for(num_cached + num_new_tokens) - len(hits)):
            seq.block_table.append(self._take_free_block())
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += num_cached
        return num_cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow a running `seq`'s block table to hold `num_new_tokens` more tokens."""
        assert self.can_append(seq, num_new_tokens)
        for _ in range(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def cache_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the full blocks of `seq` whose K/V are now computed in the prefix cache.

        Called when a step's results are back, with `num_computed` = the tokens that step
        has written (default `seq.num_computed_tokens`, which may already count steps still
        in flight), so a cached block always holds real K/V and real token ids. A block whose
        content is already cached elsewhere stays private.
        """
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        num_full = min(num_computed // self.block_size, len(seq.block_table))
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        keys = self._keys(seq, num_full)
        for i in range(start, num_full):
            key = keys[i]
            block = self.blocks[seq.block_table[i]]
            if block.key is None and key not in self.cached:
                block.key = key
                self.cached[key] = block.block_id
        self._num_registered[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks (finished, aborted or preempted)."""
        # Release in reverse so a sequence's tail blocks (least likely shared) are evicted first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self.evictable_block_ids[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table = []
        self._seq_keys.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content of free blocks (e.g. after weights change)."""
        for block_id in list(self.evictable_block_ids):
            block = self.blocks[block_id]
            del self.cached[block.key]  # type: ignore[arg-type]
            block.key = None
            self.free_block_ids.append(block_id)
        self.evictable_block_ids.clear()
