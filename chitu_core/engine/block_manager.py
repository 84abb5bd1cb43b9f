"""The block manager: KV-cache block ids, reference counts and the prefix cache.

What a block holds is the attention backend's business; here a block is an id,
a reference count and, once full, the hash of its tokens chained to the hash of
the block before it (so equal hashes mean equal prefixes). Full blocks stay in
the prefix cache after their sequences finish, until their slot is needed:
blocks with no references wait in a free queue, least recently released first,
and a block taken from there is evicted from the cache. A sequence's blocks are
released tail first, so a prefix outlives its own continuations.

Blocks never written are taken before released ones (the prefix cache keeps the
most), or with ``reuse_first`` after them: where a cache's memory becomes
resident only as it is written (``PagedKVBackend.commits_on_write``), that keeps
resident memory to the most blocks in use at once instead of the whole budget.

Counts of prefix-cache lookups are kept in tokens: ``prefix_queries`` tokens
looked up, ``prefix_hits`` of them found.
"""

from collections import OrderedDict
from dataclasses import dataclass

from chitu_core.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, reuse_first: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.reuse_first = enable_prefix_caching, reuse_first
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict()  # released blocks, least recently first
        self.ever_taken = 0  # blocks [0, ever_taken) have been taken; the rest never were
        self.cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = self.prefix_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks with no reference (some may still hold cached prefixes, evictable on demand)."""
        return len(self.free_queue) + self.num_blocks - self.ever_taken

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live sequences."""
        return 1.0 - self.num_free / self.num_blocks

    def block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Chained hashes of the full blocks among ``seq``'s first ``num_tokens`` tokens (memoized on seq)."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(seq.tokens(i * bs, (i + 1) * bs)))))
        return hashes[: num_tokens // bs]

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence that holds no blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute (its logits are needed). Sets
        ``seq.num_computed_tokens`` and returns the number of tokens found."""
        assert not seq.block_table, "match_prefix is for sequences that hold no blocks"
        if not self.enable_prefix_caching:
            return 0
        hashes = self.block_hashes(seq, seq.num_tokens - 1)
        self.prefix_queries += seq.num_tokens
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        found = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = found
        self.prefix_hits += found
        return found

    def unmatch(self, seq: Sequence) -> None:
        """Undo ``match_prefix`` for a sequence that could not be admitted after all."""
        found = len(seq.block_table) * self.block_size
        self.prefix_queries -= seq.num_tokens
        self.prefix_hits -= found
        self.free(seq)
        seq.num_computed_tokens = 0

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_tokens`` tokens in all."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"sequence {seq.seq_id} needs {need} KV blocks, {self.num_free} are free")
        for _ in range(need):
            fresh = self.ever_taken < self.num_blocks and not (self.reuse_first and self.free_queue)
            block_id = self.ever_taken if fresh else next(iter(self.free_queue))
            self.ever_taken += fresh
            self._take(block_id)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the prefix this block held
                del self.cached[block.hash]
                block.hash = None
            seq.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter ``seq``'s computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching or seq.num_computed_tokens // self.block_size == seq.num_cached_blocks:
            return  # no block filled up since the last call (most decode steps)
        hashes = self.block_hashes(seq, seq.num_computed_tokens)
        for i in range(seq.num_cached_blocks, len(hashes)):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
        seq.num_cached_blocks = len(hashes)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first; it holds no blocks afterwards."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_queue.pop(block_id, None)  # absent: never taken before
        block.ref_count += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        for block in self.blocks:
            block.hash = None
        self.cached.clear()
