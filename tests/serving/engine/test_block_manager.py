"""BlockManager: exact block tables, free-list order, prefix hits, ref counts, LRU eviction."""

from __future__ import annotations

from serving.engine.block_manager import BlockManager
from core_factories import make_sequence


def _refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def _compute(bm: BlockManager, seq, num_tokens: int) -> None:
    """Pretend a step computed `num_tokens` more tokens of `seq`."""
    seq.num_computed_tokens += num_tokens
    bm.cache_computed_blocks(seq)


def test_allocate_append_free_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_sequence(0, list(range(10)))
    assert bm.can_allocate(seq, 10)
    assert bm.allocate(seq, 10) == 0
    assert seq.block_table == [0, 1, 2]
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]
    seq.num_computed_tokens = 10
    seq.token_ids.append(99)
    bm.append_slots(seq, 1)  # token 11 fits in block 2
    assert seq.block_table == [0, 1, 2]
    seq.num_computed_tokens = 12
    bm.append_slots(seq, 1)  # token 13 needs a new block
    assert seq.block_table == [0, 1, 2, 3]
    assert _refs(bm) == [1, 1, 1, 1, 0, 0, 0, 0]
    bm.free(seq)
    assert seq.block_table == []
    # Uncached blocks return to the tail, the sequence's last block first.
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert bm.num_free_blocks == 8 and _refs(bm) == [0] * 8


def test_prefix_hit_shares_full_blocks_and_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_sequence(0, list(range(10)))
    bm.allocate(a, 10)
    _compute(bm, a, 10)  # blocks 0 and 1 are full and computed -> cached; block 2 partial
    assert bm.blocks[0].key is not None and bm.blocks[1].key is not None and bm.blocks[2].key is None
    b = make_sequence(1, list(range(8)) + [50, 51, 52])
    assert bm.num_cached_tokens(b) == 8
    assert bm.allocate(b, 3) == 8
    assert b.block_table == [0, 1, 3]
    assert _refs(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_prefix_hits == 8 and bm.num_prefix_queries == 21
    bm.free(a)
    assert _refs(bm)[:4] == [1, 1, 0, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2] and list(bm.evictable_block_ids) == []
    bm.free(b)
    # Cached blocks go to the evictable LRU pool (tail blocks first), others to the free list.
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2, 3]
    assert list(bm.evictable_block_ids) == [1, 0]
    assert bm.num_free_blocks == 8


def test_hit_leaves_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_sequence(0, list(range(8)))
    bm.allocate(a, 8)
    _compute(bm, a, 8)
    same = make_sequence(1, list(range(8)))
    # Both blocks are cached, but the last token's logits are needed: only block 0 is a hit.
    assert bm.num_cached_tokens(same) == 4
    assert bm.allocate(same, 4) == 4
    assert same.block_table == [0, 2]


def test_no_hit_on_different_tokens_or_different_parent() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a, 9)
    _compute(bm, a, 9)
    # Same second block, different first block: the chained key differs, no hit at all.
    assert bm.num_cached_tokens(make_sequence(1, [9, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
    # Same first block, different second block: one block hit.
    assert bm.num_cached_tokens(make_sequence(2, [1, 2, 3, 4, 5, 6, 7, 0, 9])) == 4


def test_lru_eviction_order_and_uncached_blocks_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_sequence(0, list(range(9)))  # 3 blocks, 2 full
    bm.allocate(a, 9)
    _compute(bm, a, 9)
    bm.free(a)
    assert list(bm.free_block_ids) == [3, 2] and list(bm.evictable_block_ids) == [1, 0]
    c = make_sequence(1, [100 + i for i in range(13)])  # needs 4 blocks, no hits
    assert bm.can_allocate(c, 13)
    bm.allocate(c, 13)
    # Uncached free blocks first, then cached ones, least recently freed first.
    assert c.block_table == [3, 2, 1, 0]
    assert bm.cached == {} and all(b.key is None for b in bm.blocks)
    assert not bm.can_allocate(make_sequence(2, [1]), 1)
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_can_allocate_does_not_count_hit_blocks_twice() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_sequence(0, list(range(9)))
    bm.allocate(a, 9)
    _compute(bm, a, 9)
    bm.free(a)  # free [2], evictable [1, 0]
    b = make_sequence(1, list(range(12)))  # hits blocks 0,1; needs 1 more block
    assert bm.num_cached_tokens(b) == 8
    assert bm.can_allocate(b, 4)
    c = make_sequence(2, list(range(8)) + [7] * 8)  # hits 0,1; needs 2 more, only 1 left
    assert not bm.can_allocate(c, 8)
    assert bm.allocate(b, 4) == 8
    assert b.block_table == [0, 1, 2] and bm.num_free_blocks == 0


def test_reregistering_same_content_keeps_first_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_sequence(0, list(range(5)))
    b = make_sequence(1, list(range(5)))
    bm.allocate(a, 5)
    bm.allocate(b, 5)  # both admitted before either computed: no sharing possible yet
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    _compute(bm, a, 5)
    _compute(bm, b, 5)
    assert bm.blocks[0].key is not None and bm.blocks[2].key is None  # b's copy stays private
    bm.free(b)
    assert list(bm.free_block_ids) == [4, 5, 3, 2]
    bm.free(a)
    assert list(bm.evictable_block_ids) == [0]


def test_donor_sharing_without_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    leader = make_sequence(0, list(range(10)), request_id="r", index=0)
    bm.allocate(leader, 10)
    _compute(bm, leader, 10)
    assert bm.cached == {}
    sibling = make_sequence(1, list(range(10)), request_id="r", index=1)
    assert bm.num_cached_tokens(sibling) == 0
    assert bm.allocate(sibling, 2, donor=leader) == 8
    assert sibling.block_table == [0, 1, 3]
    assert _refs(bm)[:4] == [2, 2, 1, 1]
    bm.free(leader)
    bm.free(sibling)
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2, 3, 1, 0] and bm.num_free_blocks == 8


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_sequence(0, list(range(9)))
    bm.allocate(a, 9)
    _compute(bm, a, 9)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.cached == {} and list(bm.evictable_block_ids) == [] and list(bm.free_block_ids) == [3, 2, 1, 0]


def test_no_hit_for_a_prompt_whose_logprobs_are_asked_for() -> None:
    """Cached positions are never computed, so they would have no prompt logprob (echo + logprobs,
    decoder_input_details): such a prompt is computed whole, from the cache and from a donor."""
    for caching in (True, False):
        bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
        a = make_sequence(0, list(range(10)))
        bm.allocate(a, 10)
        _compute(bm, a, 10)
        b = make_sequence(1, list(range(10)), prompt_logprobs=0)
        assert bm.num_cached_tokens(b, donor=a) == 0 and bm.allocate(b, 10, donor=a) == 0
        assert not set(b.block_table) & set(a.block_table)
