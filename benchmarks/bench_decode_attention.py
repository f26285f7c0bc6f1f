"""Decode attention on CPU: the paged decode kernel, the two-GEMM path and SDPA, alone and in the engine.

    .venv/bin/python benchmarks/bench_decode_attention.py [--repeats 2] [--length-scale 1.0]

1. One decode group (64 queries, 9 heads over 3 KV heads, D 64, 640 keys, bf16): median ms
   and max error against a float32 reference, for SDPA (the first path), the torch path's
   `_decode_attention` (gather + two GEMMs) and the C++ kernel reading the paged cache.
2. chat-cpu (64 requests) through the engine, bf16, with each path in turn (alternating,
   `--repeats` runs each): output tok/s, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import quantpipe.runtime.model.attention as attention
from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model import cpu_attention
from quantpipe.runtime.workload import materialize, preset


def sdpa_decode(q, k, v, mask):
    """The runtime's decode attention before: SDPA over the gathered, transposed K/V."""
    qd = q.unsqueeze(2)
    kd, vd = k.transpose(1, 2), v.transpose(1, 2)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[2]).squeeze(2)


def median_ms(fn, n=15):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def micro():
    g = torch.Generator().manual_seed(0)
    b, length, kvh, h, d = 64, 640, 3, 9, 64
    q = torch.randn(b, h, d, generator=g).bfloat16()
    k, v = (torch.randn(b, length, kvh, d, generator=g).bfloat16() for _ in "kv")
    lens = torch.randint(300, length + 1, (b,), generator=g)
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    ref = sdpa_decode(q.float(), k.float(), v.float(), mask)
    for name, fn in (("sdpa", sdpa_decode), ("two_gemm", attention._decode_attention)):
        err = (fn(q, k, v, mask).float() - ref).abs().max().item()
        print(f"{name:9s} {median_ms(lambda f=fn: f(q, k, v, mask)):6.2f} ms, max error vs float32 {err:.4f}")
    ext = cpu_attention.extension()
    if ext is not None:  # the same K/V as a paged cache: block b of sequence i is block i * 40 + b
        kc, vc = (x.reshape(b * length, kvh, d) for x in (k, v))
        table = torch.arange(b * length // 16).reshape(b, -1)
        run = lambda: ext.paged_decode(q, kc, vc, table, lens, 16)  # noqa: E731
        err = (run().float() - ref).abs().max().item()
        print(f"{'kernel':9s} {median_ms(run):6.2f} ms, max error vs float32 {err:.4f}")


def engine_tok_s(llm: LLM, prompts, outs) -> float:
    eng = llm.engine
    for p, n in zip(prompts, outs):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return sum(outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--skip-sdpa", action="store_true", help="engine runs of the torch path and the kernel only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    micro()
    llm = LLM(dtype="bfloat16", device="cpu", max_num_seqs=64)
    reqs = materialize(preset("chat-cpu", length_scale=args.length_scale), llm.get_tokenizer())
    prompts, outs = [r.prompt_ids for r in reqs], [r.output_tokens for r in reqs]
    ours, kernel = attention._decode_attention, llm.engine.runner.decode_kernel
    variants = {"sdpa": (sdpa_decode, None), "two_gemm": (ours, None)}
    if args.skip_sdpa:
        del variants["sdpa"]
    if kernel is not None:
        variants["kernel"] = (ours, kernel)
    runs = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (fn, dk) in variants.items():
            attention._decode_attention, llm.engine.runner.decode_kernel = fn, dk
            llm.engine.pool.reset_prefix_cache()  # every run prefills its prompts
            runs[name].append(engine_tok_s(llm, prompts, outs))
            print(f"chat-cpu engine, {name}: {runs[name][-1]:.1f} tok/s", flush=True)
    attention._decode_attention, llm.engine.runner.decode_kernel = ours, kernel
    med = {n: statistics.median(r) for n, r in runs.items()}
    base = next(iter(med))
    print("median tok/s: " + ", ".join(f"{n} {v:.1f} ({v / med[base]:.2f}x {base})" for n, v in med.items()))


if __name__ == "__main__":
    main()
