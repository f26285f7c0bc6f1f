"""Fixed-size KV blocks: a free list, reference counts and a prefix cache.

A block that fills up gets a chained hash of (parent hash, its token ids). When its
last user frees it, it keeps that hash and joins the tail of the free list; a later
request whose prompt hashes the same takes it back instead of recomputing it. Blocks
are reused from the head of the free list, so the least recently freed go first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

NO_HASH = -1
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    """A stable 63-bit hash of a full block chained to its parent."""
    data = struct.pack(f"<q{len(token_ids)}q", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int = NO_HASH


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (head first). Cached ones keep their hash here.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0, block
            if block.block_hash != NO_HASH:  # evict its cached content
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = NO_HASH
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, block_hashes: list[int]) -> list[int]:
        """Longest run of cached blocks for these hashes; takes a reference on each."""
        hits = []
        for h in block_hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            hits.append(block_id)
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def commit(self, block_id: int, block_hash: int) -> None:
        """Publish a block that just became full under its chained hash."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        assert block.ref_count > 0 and block.block_hash == NO_HASH, block
        block.block_hash = block_hash
        # If an identical block is already published, keep that one; this copy is evicted normally.
        self.cached.setdefault(block_hash, block_id)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference per block. Pass them in eviction order: first evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, block
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash != NO_HASH and self.cached.get(block.block_hash) != block_id:
                    block.block_hash = NO_HASH  # a duplicate nobody can find: reuse it first
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)
                else:
                    self.free[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in self.free:
            self.blocks[block_id].block_hash = NO_HASH
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self.free), block
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h, (h, block_id)
        assert len(self.free) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks
