"""KV block bookkeeping: a reference-counted block pool with automatic prefix caching.

No tensors live here (the model runner owns them); this module decides which
block ids a request's tokens occupy. A full block is named by a hash of
(parent block's hash, its token ids), so two requests with the same prefix
arrive at the same chain of names and share the blocks. A block whose last
user leaves keeps its name and stays findable until the pool needs it back:
the free list is LRU, and taking a block from it evicts its name.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request


@dataclass(eq=False)
class KVBlock:
    """One block of KV slots: who holds it, and the content name it is findable by."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    """Blocks with reference counts, an LRU free list and a hash -> block index."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head is the least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Several blocks may hold the same content (computed by two requests before
        # either was named): any of them serves a lookup, and evicting one keeps the rest.
        self._by_hash: dict[int, dict[int, KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        """Size of the pool."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request holds (idle cached ones included: they can be evicted)."""
        return len(self._free)

    def allocate(self) -> KVBlock:
        """Take the least recently freed block, evicting any prefix it still named."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            same_content = self._by_hash[block.block_hash]
            del same_content[block_id]
            if not same_content:
                del self._by_hash[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Share a cached block: one more user, and out of the free list if it was idle."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: KVBlock) -> None:
        """One user fewer; at zero the block joins the free list, still findable by name."""
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None

    def lookup(self, block_hash: int) -> KVBlock | None:
        """A block with this content, preferring one in use: sharing it costs no free block."""
        same_content = self._by_hash.get(block_hash, {}).values()
        return max(same_content, key=lambda block: block.ref_count > 0, default=None)

    def register(self, block: KVBlock, block_hash: int) -> None:
        """Name a full block (naming it again, from a request that shares it, is a no-op)."""
        block.block_hash = block_hash
        self._by_hash.setdefault(block_hash, {})[block.block_id] = block


class KVCacheManager:
    """Maps requests to blocks: prefix lookup, slot allocation, caching and freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queries = 0
        self.num_hits = 0
        self._num_registered: dict[str, int] = {}

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (idle cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_seqs_fitting(self, num_tokens: int) -> int:
        """Sequences of `num_tokens` tokens each that the whole pool holds at once."""
        return self.pool.num_blocks // -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of full blocks of this request already in the cache.

        At least one token is always left to compute, because the step that
        computes it is the one that produces the next token's logits. A request
        that wants its prompt's logprobs computes it all.
        """
        if not self.enable_prefix_caching or _computes_whole_prompt(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request: Request, num_tokens: int, cached: list[KVBlock]) -> bool:
        """Whether `num_tokens` tokens in all fit, counting the cached blocks it would share."""
        return self._num_blocks_missing(request, num_tokens, cached) <= 0

    def allocate(self, request: Request, num_tokens: int, cached: list[KVBlock]) -> None:
        """Give `request` blocks for `num_tokens` tokens in all, `cached` ones first."""
        assert self.can_allocate(request, num_tokens, cached), "allocate without can_allocate"
        if not request.block_ids:  # admission: count the prefix-cache lookup once
            self.num_queries += request.num_tokens
            self.num_hits += len(cached) * self.block_size
        for block in cached:
            self.pool.touch(block)
            request.block_ids.append(block.block_id)
        num_needed = -(-num_tokens // self.block_size) - len(request.block_ids)
        request.block_ids.extend(self.pool.allocate().block_id for _ in range(num_needed))

    def _num_blocks_missing(self, request: Request, num_tokens: int, cached: list[KVBlock]) -> int:
        num_needed = -(-num_tokens // self.block_size) - len(request.block_ids) - len(cached)
        # Idle cached blocks sit in the free list: sharing them takes them out of it.
        num_idle_cached = sum(1 for block in cached if block.ref_count == 0)
        return num_needed - (self.pool.num_free_blocks - num_idle_cached)

    def cache_full_blocks(self, request: Request) -> None:
        """Name every block whose tokens are all computed, so later requests can share it.

        Draft tokens computed this step are not yet tokens of the request (they may
        be rejected), so only blocks of real tokens are named.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.register(self.pool.blocks[request.block_ids[i]], request.block_hashes[i])
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release blocks past those `num_tokens` tokens need: rejected draft lookahead."""
        num_keep = -(-num_tokens // self.block_size)
        for block_id in reversed(request.block_ids[num_keep:]):
            self.pool.release(self.pool.blocks[block_id])
        del request.block_ids[num_keep:]

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first so tails are evicted first."""
        for block_id in reversed(request.block_ids):
            self.pool.release(self.pool.blocks[block_id])
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, size, tokens = request.block_hashes, self.block_size, request.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(tokens[i * size : (i + 1) * size]))))


def _computes_whole_prompt(request: Request) -> bool:
    """Prompt scores and embeddings need every prompt position's hidden state, which the
    cache's K/V cannot give: such a request computes its prompt from the start."""
    return request.params.prompt_logprobs is not None or request.pooling is not None
