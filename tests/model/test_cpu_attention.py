"""The CPU paged decode kernel against the torch path (gather + two GEMMs) on real block tables."""

from __future__ import annotations

import pytest
import torch

from quantpipe.runtime.model.attention import AttentionMetadata, DecodeGroup, paged_attention
from quantpipe.runtime.model.cpu_attention import build_directory, extension
from quantpipe.runtime.model.kv_cache import KVCache, QuantizedKVCache

BS = 16


@pytest.fixture(scope="module")
def ext():
    ext = extension()
    if ext is None:
        pytest.fail("the CPU paged decode kernel did not build (scripts/setup builds it; see its warning)")
    return ext


def test_a_lock_left_by_a_killed_build_does_not_block_later_loads(ext):
    """torch's build `lock` file, as a builder killed mid-build leaves it: a new process
    still loads the module (before, it waited on the file forever)."""
    import subprocess
    import sys

    lock = build_directory(ext.__name__) / "lock"
    lock.write_text("")
    try:
        run = subprocess.run([sys.executable, "-c", "from quantpipe.runtime.model.cpu_attention import extension; "
                              "assert extension() is not None"], capture_output=True, text=True, timeout=600)
    finally:
        lock.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-2000:]


def _case(dtype, kvh=3, heads=9, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(40 * BS, kvh, d, dtype, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    # Sequences 0 and 2 share their first two blocks (a prefix-cache hit); padding entries are 0.
    lens = torch.tensor([45, 1, 40, 16, 17])
    rows = [[5, 9, 2], [30], [5, 9, 31], [7], [11, 12]]
    table = torch.tensor([r + [0] * (3 - len(r)) for r in rows])
    q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
    mask = (torch.arange(3 * BS)[None, :] < lens[:, None])[:, None, None, :]
    return cache, table, lens, mask, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_kernel_matches_the_torch_path(ext, dtype, heads, kvh):
    cache, table, lens, mask, q = _case(dtype, kvh=kvh, heads=heads)
    empty = torch.empty(0, kvh, 64, dtype=dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS,
                             decodes=[DecodeGroup(0, len(lens), table, mask, lens)])
    expected = paged_attention(q, empty, empty, cache, meta)  # no new tokens: reads what is cached
    got = ext.paged_decode(q, cache.k, cache.v, table, lens, BS)
    assert got.dtype == dtype
    bound = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the torch path rounds P to bf16
    assert (got.float() - expected.float()).abs().max().item() < bound


def test_kernel_refuses_indices_outside_the_cache(ext):
    cache, table, lens, _, q = _case(torch.float32)
    with pytest.raises(RuntimeError, match="context_lens must be in"):
        ext.paged_decode(q, cache.k, cache.v, table, lens + 100, BS)
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        ext.paged_decode(q, cache.k, cache.v, table + 40, lens, BS)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ext.paged_decode(q.bfloat16(), cache.k, cache.v, table, lens, BS)


def test_the_engine_decodes_through_the_kernel_on_cpu():
    from quantpipe.runtime import LLM

    llm = LLM(dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory="64MiB")
    assert llm.engine.runner.decode_kernel is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (4, 4, 64), (4, 2, 128)], ids=["gqa", "mha", "d128"])
def test_int8_kernel_matches_the_torch_path(ext, dtype, heads, kvh, d):
    """A dynamic INT8 cache read in place (int8 rows, each token's scale applied once) against
    the torch path, which gathers and dequantizes; both in the cache's rotated basis. Head
    size 64 takes the AVX-512 path where the CPU has one, 128 the plain loops."""
    _, table, lens, mask, q = _case(dtype, kvh=kvh, heads=heads, d=d, seed=2)
    cache = QuantizedKVCache(40 * BS, kvh, d, dtype, "cpu", "int8")
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(40 * BS, kvh, d, generator=g) * 3, torch.randn(40 * BS, kvh, d, generator=g)
    cache.write(torch.arange(40 * BS), k.to(dtype), v.to(dtype))
    empty = torch.empty(0, kvh, d, dtype=dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS,
                             decodes=[DecodeGroup(0, len(lens), table, mask, lens)])
    expected = paged_attention(q, empty, empty, cache, meta).float()  # gather + GEMMs
    rot = cache.rotation
    got = ext.paged_decode_int8((q.float() @ rot).to(dtype), cache.q[0], cache.q[1], cache.scale[0], cache.scale[1],
                                table, lens, BS)
    assert got.dtype == dtype
    got = got.float() @ rot.mT
    bound = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: q, P and the output rounded on either side
    assert (got - expected).abs().max().item() < bound
    with pytest.raises(RuntimeError, match="INT8 K/V scales must be contiguous float16"):
        ext.paged_decode_int8(q, cache.q[0], cache.q[1], cache.scale[0].float(), cache.scale[1], table, lens, BS)


def test_the_engine_decodes_int8_caches_through_the_kernel():
    """The runner hands paged_attention the kernel for a dynamic INT8 cache, and greedy output
    (float32, one batch) is the torch path's."""
    from quantpipe.runtime import LLM, SamplingParams

    llms = [LLM(dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory="16MiB", kv_cache_dtype="int8",
                disable_cpu_kernels=off) for off in ("", "attention")]
    assert llms[0].engine.runner.decode_kernel is not None and llms[1].engine.runner.decode_kernel is None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 504, 3303, 28, 260, 1793], [1, 9690, 314, 253, 1535, 28]]
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in llms]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("heads,kvh", [(9, 3), (12, 2), (4, 4)], ids=["group3", "group6", "mha"])
def test_bf16_kernel_is_float32_accurate_but_for_the_output_rounding(ext, heads, kvh):
    # On AVX-512 BF16 CPUs bf16 caches take the vectorized path (q.k as bf16 dot products,
    # 16 keys a tile, groups of up to 4 query heads per pass over V): the same inputs in
    # float32 through the torch path must agree to the last bit bf16 can hold.
    cache, table, lens, mask, q = _case(torch.bfloat16, kvh=kvh, heads=heads, seed=1)
    cache32 = KVCache(cache.k.shape[0], kvh, 64, torch.float32, "cpu")
    cache32.k.copy_(cache.k.float())
    cache32.v.copy_(cache.v.float())
    empty = torch.empty(0, kvh, 64)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=BS,
                             decodes=[DecodeGroup(0, len(lens), table, mask, lens)])
    expected = paged_attention(q.float(), empty, empty, cache32, meta)
    got = ext.paged_decode(q, cache.k, cache.v, table, lens, BS).float()
    assert ((got - expected).abs() <= expected.abs() * 2**-8 + 1e-5).all()
