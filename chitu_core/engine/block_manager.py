"""The block manager: hands out KV-cache block ids. What a block holds is the attention backend's business."""

from collections import deque

from chitu_core.engine.sequence import Sequence


class BlockManager:
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots each; lowest ids go out first."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

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
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
