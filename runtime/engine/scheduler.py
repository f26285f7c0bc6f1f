"""Iteration-level scheduling: which requests run this step, and how many tokens each.

Every request carries `num_computed_tokens`; a step computes the next chunk of its
known tokens (prompt, or the one token sampled last step), so prefill chunks and
decodes share one token budget. A chunk that reaches the last known token is sampled.
When blocks run out, the least urgent running request is preempted by recompute.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from quantpipe.runtime.engine.block_pool import ROOT_HASH, BlockPool, hash_block
from quantpipe.runtime.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # index in request.token_ids of the first token computed
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def sample(self) -> bool:
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


def _urgency(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: list[Request] = []  # sorted by urgency
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        need = -(-(req.num_prompt_tokens + req.max_tokens) // self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.pool.num_blocks * self.block_size} tokens "
                f"({self.pool.num_blocks} blocks of {self.block_size}); this request needs "
                f"{req.num_prompt_tokens + req.max_tokens} (prompt + max_tokens): raise kv_cache_memory"
            )
        self.requests[req.request_id] = req
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        keys = [_urgency(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _urgency(req)), req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, ScheduledChunk] = {}

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self._grow(req, req.num_computed_tokens + n):
                victim = max(self.running, key=_urgency)
                chunk = scheduled.pop(id(victim), None)
                if chunk is not None:
                    budget += chunk.num_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled[id(req)] = ScheduledChunk(req, req.num_computed_tokens, n)
                budget -= n

        # Admit waiting requests only when nobody was preempted: otherwise we would thrash.
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            fresh = req.num_computed_tokens == 0 and not req.block_ids
            if fresh:
                self._update_hashes(req)
                # Never serve the last known token from the cache: it must be computed to sample.
                usable = (req.num_tokens - 1) // self.block_size
                hits = (self.pool.lookup(req.block_hashes[:usable])
                        if self.pool.enable_prefix_caching and req.read_prefix_cache else [])
                req.block_ids = hits
                req.num_committed_blocks = len(hits)
                req.num_computed_tokens = len(hits) * self.block_size
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                if fresh:
                    self._release(req)
                break
            self.waiting.pop(0)
            if fresh and req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                if req.read_prefix_cache:  # a request that may not read the cache is no miss of it
                    self.pool.record_query(req.num_prompt_tokens, req.num_computed_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[id(req)] = ScheduledChunk(req, req.num_computed_tokens, n)
            budget -= n

        out.chunks = list(scheduled.values())
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Mark the scheduled chunks computed and publish blocks they filled."""
        for chunk in out.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = chunk.end
            self._commit_full_blocks(req)

    def append_token(self, req: Request, token_id: int) -> None:
        req.token_ids.append(token_id)

    def finish(self, req: Request, reason: str, now: float) -> None:
        """Retire a request (finished or aborted) and give its blocks back."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        del self.requests[req.request_id]

    # -- blocks --------------------------------------------------------------------

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def _release(self, req: Request) -> None:
        # Tail blocks first, so a request's deepest (least shared) blocks are evicted first.
        self.pool.free_blocks(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_committed_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _update_hashes(self, req: Request) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs:(i + 1) * bs]))

    def _commit_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_committed_blocks:
            return
        self._update_hashes(req)
        for i in range(req.num_committed_blocks, full):
            self.pool.commit(req.block_ids[i], req.block_hashes[i])
        req.num_committed_blocks = full
