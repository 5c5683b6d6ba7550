"""BlockPool and KVCacheManager, without a model: reference counts, LRU, prefix hits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache import BlockPool, KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from testing.engine_helpers import (
    assert_all_blocks_free,
    assert_blocks_hold,
    assert_books_balance,
    assert_slots_hold_tokens,
    forget_fresh_blocks,
    write_slots,
)

BLOCK_SIZE = 4
PARAMS = SamplingParams(max_tokens=8)


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, PARAMS)


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """Allocate and 'compute' the whole request, past any cached prefix."""
    cached = kv.find_cached_prefix(request)
    kv.allocate(request, request.num_tokens, cached)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


# ---- BlockPool ---------------------------------------------------------------


def test_pool_hands_out_least_recently_freed_block_first():
    pool = BlockPool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    assert pool.num_free_blocks == 0
    pool.release(c)
    pool.release(a)
    assert pool.allocate() is c
    assert pool.allocate() is a


def test_pool_shared_block_is_free_only_after_last_release():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.touch(block)
    pool.release(block)
    assert (block.ref_count, pool.num_free_blocks) == (1, 1)
    pool.release(block)
    assert (block.ref_count, pool.num_free_blocks) == (0, 2)


def test_pool_double_free_is_caught():
    pool = BlockPool(1)
    block = pool.allocate()
    pool.release(block)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(block)


def test_pool_freed_named_block_stays_findable_until_evicted():
    pool = BlockPool(1)
    block = pool.allocate()
    pool.register(block, 1234)
    pool.release(block)
    assert pool.lookup(1234) is block
    pool.touch(block)  # revived from the free list
    assert (pool.num_free_blocks, block.ref_count) == (0, 1)
    pool.release(block)
    assert pool.allocate() is block  # reused for other content: the name must go
    assert pool.lookup(1234) is None
    assert block.block_hash is None


# ---- KVCacheManager ------------------------------------------------------------


def test_allocate_rounds_up_to_whole_blocks():
    kv = KVCacheManager(6, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", list(range(9)))
    kv.allocate(request, 9, [])
    assert len(request.block_ids) == 3
    kv.allocate(request, 12, [])  # still fits in the third block
    assert len(request.block_ids) == 3
    assert not kv.can_allocate(request, 9 * BLOCK_SIZE, [])
    kv.free(request)
    assert request.block_ids == []
    assert_all_blocks_free(kv)


def test_second_request_shares_full_blocks_of_the_same_prefix():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("first", list(range(10)))  # 2 full blocks + 2 tokens
    compute_all(kv, first)
    second = make_request("second", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_prefix(second)
    assert [b.block_id for b in hits] == first.block_ids[:2]
    kv.allocate(second, second.num_tokens, hits)
    assert kv.pool.blocks[first.block_ids[0]].ref_count == 2
    assert kv.num_hits == 2 * BLOCK_SIZE
    assert kv.num_queries == first.num_tokens + second.num_tokens
    assert_books_balance(kv, [first, second])


def test_prefix_hit_always_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    compute_all(kv, make_request("first", list(range(8))))
    same = make_request("same", list(range(8)))  # exactly two full blocks
    assert len(kv.find_cached_prefix(same)) == 1


def test_block_hash_covers_the_whole_prefix_not_just_the_block():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    compute_all(kv, make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other_first_block = make_request("other", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert kv.find_cached_prefix(other_first_block) == []


def test_freed_prefix_is_reused_then_evicted_lru():
    kv = KVCacheManager(3, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("first", list(range(9)))
    compute_all(kv, first)
    kv.free(first)
    assert len(kv.find_cached_prefix(make_request("again", list(range(9))))) == 2
    filler = make_request("filler", [50] * 12)  # needs every block: evicts the prefix
    kv.allocate(filler, filler.num_tokens, [])
    kv.free(filler)
    assert kv.find_cached_prefix(make_request("late", list(range(9)))) == []


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=False)
    compute_all(kv, make_request("first", list(range(10))))
    assert kv.find_cached_prefix(make_request("second", list(range(10)))) == []
    assert kv.num_hits == 0


# ---- property test -------------------------------------------------------------

# A tiny alphabet makes prompts share prefixes often, so blocks get shared and evicted.
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class KVCacheMachine(RuleBasedStateMachine):
    """Requests arrive, compute in chunks, grow, share prefixes and leave in any order.

    A shadow map slot -> token stands in for the K/V tensors: a request's
    computed positions must always find their own tokens there, so a block
    handed to two requests, evicted while in use, or found under a wrong name
    shows up as a mismatch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(6, BLOCK_SIZE, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.departed: list[list[int]] = []
        self.slot_tokens: dict[int, int] = {}
        forget_fresh_blocks(self.kv, self.slot_tokens)
        self.ids = (f"r{i}" for i in itertools.count())

    def admit(self, prompt: list[int]) -> Request | None:
        request = make_request(next(self.ids), prompt)
        cached = self.kv.find_cached_prefix(request)
        cached_ids = [block.block_id for block in cached]
        num_cached = len(cached) * BLOCK_SIZE
        assert_blocks_hold(self.slot_tokens, cached_ids, prompt[:num_cached], BLOCK_SIZE)
        if not self.kv.can_allocate(request, request.num_tokens, cached):
            return None
        self.kv.allocate(request, request.num_tokens, cached)
        request.num_computed_tokens = num_cached
        self.live[request.request_id] = request
        return request

    @rule(prompt=token_lists)
    def arrive(self, prompt: list[int]) -> None:
        self.admit(prompt)

    @precondition(lambda self: self.departed)
    @rule(data=st.data())
    def arrive_again(self, data: st.DataObject) -> None:
        """The same conversation comes back: its blocks may be cached, or evicted since."""
        self.admit(data.draw(st.sampled_from(self.departed)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def share_a_live_prefix(self, data: st.DataObject) -> None:
        """A live request's computed full blocks cannot be evicted: a copy must hit them all."""
        source = self.pick(data)
        prefix = source.token_ids[: data.draw(st.integers(1, source.num_tokens))]
        hits = self.kv.find_cached_prefix(make_request("probe", prefix))
        expected_hits = min(source.num_computed_tokens, len(prefix) - 1) // BLOCK_SIZE
        assert len(hits) >= expected_hits
        copy = self.admit(prefix)  # admit() checks the hit blocks hold the prefix's tokens
        if copy is not None:
            assert copy.num_computed_tokens >= expected_hits * BLOCK_SIZE

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        request = self.pick(data)
        start = request.num_computed_tokens
        end = min(start + chunk, request.num_tokens)
        write_slots(self.slot_tokens, request, start, end, BLOCK_SIZE)
        request.num_computed_tokens = end
        self.kv.cache_full_blocks(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data: st.DataObject, token: int) -> None:
        """A decode: one more token, and a new block when the last one is full."""
        request = self.pick(data)
        if self.kv.can_allocate(request, request.num_tokens + 1, []):
            self.kv.allocate(request, request.num_tokens + 1, [])
            request.append_output_token(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        request = self.live.pop(self.pick(data).request_id)
        self.kv.free(request)
        self.departed.append(request.token_ids)

    def pick(self, data: st.DataObject) -> Request:
        return data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))

    @invariant()
    def books_balance(self) -> None:
        assert_books_balance(self.kv, list(self.live.values()))

    @invariant()
    def computed_slots_hold_their_tokens(self) -> None:
        for request in self.live.values():
            assert_slots_hold_tokens(self.slot_tokens, request, BLOCK_SIZE)

    def teardown(self) -> None:
        for request in self.live.values():
            self.kv.free(request)
        assert_all_blocks_free(self.kv)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_a_duplicate_block_keeps_its_content_findable_when_the_other_is_evicted():
    """Two requests compute the same first block before either names it; evicting one
    copy must leave the other findable (a single name per content lost it)."""
    kv = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    first, second = (make_request(name, [7] * BLOCK_SIZE + [1]) for name in ("a", "b"))
    for request in (first, second):  # both allocate before either names its blocks
        kv.allocate(request, request.num_tokens, [])
    for request in (first, second):
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
    kv.free(first)
    filler = make_request("filler", [3] * (2 * BLOCK_SIZE))  # takes a's blocks, evicting them
    kv.allocate(filler, filler.num_tokens, [])
    hits = kv.find_cached_prefix(make_request("c", [7] * BLOCK_SIZE + [2]))
    assert [block.block_id for block in hits] == [second.block_ids[0]]
