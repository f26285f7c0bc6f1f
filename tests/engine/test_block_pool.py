"""BlockPool invariants under random allocate / append / fork-by-prefix / free / preempt."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quantpipe.runtime.engine.block_pool import NO_HASH, ROOT_HASH, BlockPool, hash_block

BS = 4


def chain(tokens: list[int]) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS:(i + 1) * BS])
        hashes.append(parent)
    return hashes


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, BS)
        self.seqs: dict[int, tuple[list[int], list[int], int]] = {}  # id -> (tokens, blocks, committed)
        self.next_id = 0

    def _commit(self, sid):
        tokens, blocks, committed = self.seqs[sid]
        hashes = chain(tokens)
        for i in range(committed, min(len(hashes), len(blocks))):
            self.pool.commit(blocks[i], hashes[i])
        self.seqs[sid] = (tokens, blocks, max(committed, min(len(hashes), len(blocks))))

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def allocate(self, tokens):
        # Fork by prefix: reuse cached blocks for the prompt's full blocks (never the last token).
        usable = (len(tokens) - 1) // BS
        hits = self.pool.lookup(chain(tokens)[:usable])
        need = -(-len(tokens) // BS) - len(hits)
        if need > self.pool.num_free:
            self.pool.free_blocks(list(reversed(hits)))
            return
        blocks = hits + self.pool.allocate(need)
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = (list(tokens), blocks, len(hits))
        self._commit(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, blocks, committed = self.seqs[sid]
        if len(tokens) == len(blocks) * BS:
            if self.pool.num_free == 0:
                return
            blocks = blocks + self.pool.allocate(1)
        self.seqs[sid] = (tokens + [token], blocks, committed)
        self._commit(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_or_preempt(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, blocks, _ = self.seqs.pop(sid)
        self.pool.free_blocks(list(reversed(blocks)))

    @invariant()
    def pool_consistent(self):
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for _, blocks, _ in self.seqs.values():
            for b in blocks:
                refs[b] += 1
        assert refs == [b.ref_count for b in self.pool.blocks]

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        # Every published hash belongs to a block whose content a live or past sequence computed.
        for h, block_id in self.pool.cached.items():
            assert self.pool.blocks[block_id].block_hash == h != NO_HASH

    def teardown(self):
        for _, blocks, _ in self.seqs.values():
            self.pool.free_blocks(list(reversed(blocks)))
        self.pool.check_invariants()
        assert all(b.ref_count == 0 for b in self.pool.blocks)
        assert self.pool.num_free == self.pool.num_blocks


TestBlockPool = PoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_returns_the_same_block_after_free():
    pool = BlockPool(4, BS)
    tokens = [1, 2, 3, 4, 5]
    (b0, b1) = pool.allocate(2)
    pool.commit(b0, chain(tokens)[0])
    pool.free_blocks([b1, b0])
    assert pool.num_free == 4
    assert pool.lookup(chain(tokens)) == [b0]
    assert pool.blocks[b0].ref_count == 1


def test_eviction_takes_least_recently_freed_first():
    pool = BlockPool(2, BS)
    a, b = pool.allocate(2)
    pool.commit(a, hash_block(ROOT_HASH, [1] * BS))
    pool.commit(b, hash_block(ROOT_HASH, [2] * BS))
    pool.free_blocks([a])
    pool.free_blocks([b])
    assert pool.allocate(1) == [a]  # a was freed first, so it is evicted first
    assert pool.lookup([hash_block(ROOT_HASH, [2] * BS)]) == [b]
    assert pool.lookup([hash_block(ROOT_HASH, [1] * BS)]) == []
