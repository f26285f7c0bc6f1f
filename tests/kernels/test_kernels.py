"""Each Triton kernel against its torch reference (in the interpreter on CPU), on small shapes
with every tail: batch sizes that are not multiples of the tile, N and K tails, masked loads."""

from __future__ import annotations

import pytest
import torch

from quantpipe.formats.packing import pack_int32
from quantpipe.kernels import int8_gemm, mixed_gemm, paged_attention, reference
from quantpipe.kernels.build import TOLERANCE
from quantpipe.kernels.configs import INTERPRET_CONFIGS, GemmConfig
from quantpipe.runtime.engine.block_pool import BlockPool, hash_block
from quantpipe.runtime.model.attention import AttentionMetadata, DecodeGroup
from quantpipe.runtime.model.attention import paged_attention as runtime_attention
from quantpipe.runtime.model.kv_cache import make_kv_cache

ROWS = (1, 5, 19)  # one row, a partial tile of 16, two tiles
# On a GPU the same tests run the compiled kernels; without one, the interpreter (conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def _weights(bits: int, group: int | None, symmetric: bool, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    groups = k // group if group else 1
    scale = torch.rand((n, groups), generator=g) * 0.02 + 0.002
    zero = None if symmetric else torch.randint(lo // 4, hi // 4, (n, groups), generator=g).float()
    return pack_int32(q, bits).to(DEVICE), scale.to(DEVICE), None if zero is None else zero.to(DEVICE)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, 128, None], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
def test_mixed_gemm_matches_its_reference(bits, group, symmetric):
    # N = 72: a tail for BLOCK_N 32 and 64. K: 3 groups (a K tail for BLOCK_K 64 at group 32),
    # or 164 per channel (a tail for every BLOCK_K, and a last int32 word only partly used at 4 bits).
    n, k = 72, 3 * group if group else 164
    packed, scale, zero = _weights(bits, group, symmetric, n, k)
    for rows in ROWS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.randn((rows, k), generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
            ref = reference.mixed_gemm_ref(x, packed, scale, zero, bits, group)
            for config in INTERPRET_CONFIGS:
                y = mixed_gemm.mixed_gemm(x, packed, scale, zero, bits, group, config)
                assert y.dtype == dtype and y.shape == (rows, n)
                err = _rel_err(y, ref)
                assert err <= TOLERANCE[dtype], (rows, dtype, str(config), err)


def test_mixed_gemm_names_what_it_cannot_run():
    packed, scale, _ = _weights(4, 32, True, 16, 96)
    x = torch.randn(2, 96, device=DEVICE)
    with pytest.raises(ValueError, match="group size 48"):
        mixed_gemm.mixed_gemm(x, packed, torch.ones(16, 2, device=DEVICE), None, 4, 48, INTERPRET_CONFIGS[0])
    with pytest.raises(ValueError, match=r"int32 \[16, 12\]"):
        mixed_gemm.mixed_gemm(x, packed[:, :-1], scale, None, 4, 32, INTERPRET_CONFIGS[0])
    with pytest.raises(ValueError, match=r"scale must be \[16, 3\]"):
        mixed_gemm.mixed_gemm(x, packed, scale[:, :2], None, 4, 32, INTERPRET_CONFIGS[0])


def test_per_token_quantization_is_the_runtimes_grid_exactly():
    x = torch.randn(19, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[3] = 0.0  # a zero row: the scale floor, not a division by zero
    x[4, :8] = torch.tensor([127.5, -127.5, 0.5, 1.5, 2.5, -0.5, 63.75, 0.0]) / 127.5  # ties at amax 1
    q, s = int8_gemm.quantize_per_token(x.to(DEVICE), block=128)
    q_ref, s_ref = (t.to(DEVICE) for t in reference.quantize_per_token_ref(x))
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)


def test_w8a8_gemm_matches_its_exact_integer_reference():
    g = torch.Generator().manual_seed(1)
    n, k = 72, 164
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    ws = (torch.rand(n, 1, generator=g) * 0.01).to(DEVICE)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn((rows, k), generator=g).to(DEVICE, dtype)
            ref = reference.w8a8_gemm_ref(x, w, ws)
            for config in (c for c in INTERPRET_CONFIGS if c.split_k == 1):
                y = int8_gemm.w8a8_gemm(x, w, ws, config)
                assert y.dtype == dtype
                assert _rel_err(y, ref) <= TOLERANCE[dtype], (rows, dtype, str(config))
    with pytest.raises(ValueError, match="split_k must be 1"):
        int8_gemm.w8a8_gemm(x, w, ws, GemmConfig(16, 32, 32, split_k=2))


BLOCK = 16


def _shared_prefix_tables(pool: BlockPool, prompt_lens: list[int], shared_tokens: int, sharing: set[int]):
    """Block tables as the engine builds them: the prompts in `sharing` find the first's full
    prefix blocks in the prefix cache and take them instead of their own."""
    prefix = list(range(shared_tokens))
    hashes, h = [], 0
    for i in range(shared_tokens // BLOCK):
        h = hash_block(h, prefix[i * BLOCK:(i + 1) * BLOCK])
        hashes.append(h)
    tables, fresh = [], []  # fresh: (table index, first position this sequence writes itself)
    for j, n in enumerate(prompt_lens):
        hits = pool.lookup(hashes) if j in sharing else []
        own = pool.allocate(-(-n // BLOCK) - len(hits))
        table = hits + own
        if j == 0:
            for b, hb in zip(table, hashes):
                pool.commit(b, hb)
        tables.append(table)
        fresh.append(len(hits) * BLOCK)
    return tables, fresh


@pytest.mark.parametrize("kind", ["auto", "int8", "int8-static"])
def test_paged_decode_matches_the_runtime_attention_on_shared_prefix_blocks(kind):
    """The kernel reads the same cache the runtime's attention (gather + SDPA) reads, and agrees."""
    kvh, heads, d = 3, 9, 64
    g = torch.Generator().manual_seed(2)
    static = (torch.rand(kvh, d, generator=g) * 0.05 + 0.01, torch.rand(kvh, 1, generator=g) * 0.05 + 0.01) \
        if kind == "int8-static" else None
    pool = BlockPool(num_blocks=24, block_size=BLOCK)
    pool.allocate(2)  # blocks 0 and 1 in use elsewhere: tables are not 0..n
    lens = [45, 40, 7, 33]  # each sequence's context, including its new token
    tables, fresh = _shared_prefix_tables(pool, lens, shared_tokens=32, sharing={1, 3})
    assert tables[1][:2] == tables[0][:2] and tables[3][:2] == tables[0][:2]
    pool.check_invariants()
    cache = make_kv_cache(24 * BLOCK, kvh, d, torch.float32, DEVICE, kind.removesuffix("-static"), static)
    prefix_kv = torch.randn(32, kvh, d, generator=g), torch.randn(32, kvh, d, generator=g)
    for table, n, start in zip(tables, lens, fresh):  # prompts: all but the new token, shared blocks once
        pos = range(start, n - 1)
        if not pos:
            continue
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in pos])
        k, v = torch.randn(len(pos), kvh, d, generator=g), torch.randn(len(pos), kvh, d, generator=g)
        if start == 0 and n > 32:
            k[:32], v[:32] = prefix_kv[0][:len(k[:32])], prefix_kv[1][:len(v[:32])]
        cache.write(slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    # One decode step through the runtime's attention: it writes each new token, then attends.
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    max_blocks = max(len(t) for t in tables)
    table = torch.tensor([tables[i] + [0] * (max_blocks - len(tables[i])) for i in order])
    ctx = torch.tensor([lens[i] for i in order])
    mask = (torch.arange(max_blocks * BLOCK)[None, :] < ctx[:, None])[:, None, None, :]
    new_slots = torch.tensor([tables[i][(lens[i] - 1) // BLOCK] * BLOCK + (lens[i] - 1) % BLOCK for i in order])
    table, ctx, mask, new_slots = (t.to(DEVICE) for t in (table, ctx, mask, new_slots))
    meta = AttentionMetadata(slot_mapping=new_slots, block_size=BLOCK,
                             decodes=[DecodeGroup(0, len(order), table, mask, ctx)])
    q = torch.randn(len(order), heads, d, generator=g).to(DEVICE)
    k_new, v_new = (torch.randn(len(order), kvh, d, generator=g).to(DEVICE) for _ in "kv")
    expected = runtime_attention(q, k_new, v_new, cache, meta)
    # The kernel itself works in the cache's basis: the runtime turns q into it and the output back.
    rot = cache.rotation
    assert (rot is not None) == (kind == "int8")
    got = paged_attention.paged_decode(q if rot is None else q @ rot, cache, table, ctx, BLOCK)
    assert _rel_err(got if rot is None else got @ rot.mT, expected) <= 1e-5
    # ... and the runtime's attention runs the kernel when the runner hands it over (as on CUDA).
    meta.decode_kernel = paged_attention.paged_decode
    assert _rel_err(runtime_attention(q, k_new, v_new, cache, meta), expected) <= 1e-5


@pytest.mark.parametrize("kind", ["int8", "int8-static"])
def test_kv_write_stores_what_the_runtimes_write_stores(kind):
    kvh, d = 3, 64
    g = torch.Generator().manual_seed(3)
    static = (torch.rand(kvh, d, generator=g) * 0.05 + 0.01,) * 2 if kind == "int8-static" else None
    ours, theirs = (make_kv_cache(64, kvh, d, torch.float32, DEVICE, "int8", static) for _ in range(2))
    slots = torch.tensor([5, 17, 18, 40, 63], device=DEVICE)
    k, v = torch.randn(5, kvh, d, generator=g) * 4, torch.randn(5, kvh, d, generator=g)
    k[2] = 0.0  # a zero row: the scale floor
    k, v = k.to(DEVICE), v.to(DEVICE)
    theirs.write(slots, k, v)
    paged_attention.kv_write(ours, slots, k, v)
    for i in range(2):
        assert torch.equal(ours.q[i], theirs.q[i])
        if static is None:
            assert torch.equal(ours.scale[i], theirs.scale[i])


def test_fp8_cache_has_no_kernel_and_says_so():
    cache = make_kv_cache(32, 3, 64, torch.float32, DEVICE, "fp8")
    with pytest.raises(ValueError, match="no paged attention kernel for a fp8 KV cache"):
        paged_attention.paged_decode(torch.randn(1, 9, 64), cache, torch.tensor([[0]]), torch.tensor([3]), BLOCK)


@pytest.mark.parametrize("bits, group, symmetric, wide", [(3, 64, True, 4), (2, 32, False, 4), (6, 32, True, 8)])
def test_fewer_bits_are_the_case_and_layout_of_the_width_that_holds_them(bits, group, symmetric, wide):
    """Mixed precision's W2/W3 layers are W4A16 cases and W6 ones W8A16 cases: the same key
    (the configs tuned for that width and shape) and, through TritonMixedLinear, exactly what the
    same integers declared at that width compute."""
    from quantpipe.formats.artifact import QuantWeight
    from quantpipe.kernels.linear import TritonMixedLinear
    from quantpipe.kernels.plan import weight_case

    g = torch.Generator().manual_seed(bits)
    n, k = 40, 3 * group
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand((n, k // group), generator=g) * 0.02 + 0.002
    zero = None if symmetric else torch.randint(lo, hi, (n, k // group), generator=g).float()
    narrow, same = QuantWeight(q, scale, zero, bits, group), QuantWeight(q, scale, zero, wide, group)
    key, kernel, reason = weight_case(narrow)
    assert (key, kernel, reason) == weight_case(same) and f"/W{wide}A16/" in key and reason is None
    x = torch.randn((5, k), generator=g).to(DEVICE)
    configs = {1: INTERPRET_CONFIGS[0]}
    got = TritonMixedLinear(narrow, None, torch.float32, configs).to(DEVICE)(x)
    assert torch.equal(got, TritonMixedLinear(same, None, torch.float32, configs).to(DEVICE)(x))
    ref = x.float().cpu() @ narrow.dequantize(torch.float32).t()
    assert _rel_err(got.cpu(), ref) <= TOLERANCE[torch.float32]
