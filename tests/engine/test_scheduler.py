"""The scheduler driven without a model: a fake runner 'samples' a token per finished chunk."""

import random

import pytest

from quantpipe.runtime.engine.block_pool import BlockPool
from quantpipe.runtime.engine.request import Request
from quantpipe.runtime.engine.scheduler import Scheduler, SchedulerConfig


def run(sched: Scheduler, reqs: list[Request], max_steps=10_000):
    for r in reqs:
        sched.add(r)
    clock, steps, max_running = 0.0, 0, 0
    while sched.has_unfinished():
        out = sched.schedule(clock)
        assert out, "scheduler stalled with unfinished requests"
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        max_running = max(max_running, len(sched.running))
        for c in out.chunks:
            assert len(c.request.block_ids) * sched.block_size >= c.end
        sched.update_after_step(out)
        for c in out.chunks:
            if c.sample:
                req = c.request
                sched.append_token(req, (sum(req.token_ids) * 31 + 7) % 1000)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, "length", clock)
        sched.pool.check_invariants()
        clock += 1.0
        steps += 1
        assert steps < max_steps
    return steps, max_running


def make(n, seed=0, prefix=()):
    rng = random.Random(seed)
    return [
        Request(f"r{i}", list(prefix) + [rng.randrange(1000) for _ in range(rng.randint(1, 60))], rng.randint(1, 20), float(i))
        for i in range(n)
    ]


def test_everything_finishes_and_no_block_leaks_under_preemption():
    pool = BlockPool(num_blocks=24, block_size=4)  # room for about two requests at a time
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256), pool)
    reqs = make(30)
    run(sched, reqs)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_free == pool.num_blocks


def test_prefill_is_chunked_and_shares_steps_with_decodes():
    pool = BlockPool(num_blocks=200, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=256), pool)
    a = Request("a", [1] * 5, 20, 0.0)
    b = Request("b", list(range(40)), 2, 1.0)
    sched.add(a)
    out = sched.schedule(0)
    sched.update_after_step(out)
    sched.append_token(a, 9)
    sched.add(b)
    out = sched.schedule(1)
    kinds = {c.request.request_id: (c.num_tokens, c.sample) for c in out.chunks}
    assert kinds == {"a": (1, True), "b": (9, False)}  # a decodes, b prefills a 9-token chunk


def test_prefix_cache_hit_never_covers_last_token():
    pool = BlockPool(num_blocks=50, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), pool)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = Request("first", shared + [1, 2], 1, 0.0)
    run(sched, [first])
    again = Request("again", shared + [7, 8, 9], 1, 1.0)
    exact = Request("exact", shared[:8], 1, 2.0)  # two full blocks exactly
    run(sched, [again, exact])
    assert again.num_cached_tokens == 8
    assert exact.num_cached_tokens == 4  # the last block holds the last token: recomputed
    assert pool.num_hits == 12 and pool.num_queries == 12 + 13 + 8


def test_priority_orders_admission_and_picks_preemption_victim():
    pool = BlockPool(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), pool)
    low = Request("low", [1] * 8, 12, 0.0, priority=5)
    high = Request("high", [2] * 8, 12, 1.0, priority=0)
    run(sched, [low, high])
    assert high.first_scheduled_time <= low.first_scheduled_time
    assert high.num_preemptions == 0


def test_request_larger_than_the_cache_is_refused():
    sched = Scheduler(SchedulerConfig(), BlockPool(num_blocks=2, block_size=4))
    with pytest.raises(ValueError, match="KV cache holds 8 tokens"):
        sched.add(Request("big", [1] * 6, 4, 0.0))
    assert not sched.has_unfinished()


def test_abort_waiting_and_running_frees_blocks():
    pool = BlockPool(num_blocks=20, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), pool)
    a, b = Request("a", [1] * 9, 5, 0.0), Request("b", [2] * 9, 5, 1.0)
    sched.add(a)
    sched.add(b)
    sched.update_after_step(sched.schedule(0))
    sched.finish(a, "abort", 1)
    sched.finish(b, "abort", 1)
    assert pool.num_free == pool.num_blocks and not sched.has_unfinished()
