"""Engine benchmarks on workload chat-cpu (issue: engine core), side by side in one run.

    .venv/bin/python benchmarks/bench_engine.py [--dtype bfloat16] [--skip-hf] [--vllm-python PATH]

Prints one JSON line per measurement and a summary table; results go to BENCHMARKS.md.
- throughput: quantpipe continuous batching vs HF `generate` in static batches of 16
  (left-padded, each batch runs to its longest output, only useful tokens counted)
- vLLM CPU (optional, its own virtualenv): the same prompts through `vllm.LLM`, max_num_seqs=16
- batch-1 decode tokens/s vs HF generate at batch 1
- KV utilization at the peak of the run vs a contiguous per-request allocation
- TTFT of 32 requests sharing a 1,024-token system prompt, prefix caching on vs off
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from quantpipe.runtime import LLM, SamplingParams
from quantpipe.runtime.model.export import export_hf
from quantpipe.runtime.workload import materialize, preset


def log(name: str, **fields) -> dict:
    row = {"bench": name, **fields}
    print(json.dumps(row), flush=True)
    return row


def chat_cpu(tokenizer):
    reqs = materialize(preset("chat-cpu"), tokenizer)
    return [r.prompt_ids for r in reqs], [r.output_tokens for r in reqs]


def bench_quantpipe(llm: LLM, prompts, outs) -> dict:
    eng = llm.engine
    for p, n in zip(prompts, outs):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    peak = {"used_blocks": 0}
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        used = eng.pool.num_used
        if used > peak["used_blocks"]:
            running = eng.scheduler.running
            peak = {
                "used_blocks": used,
                "real_tokens": sum(r.num_computed_tokens for r in running),
                "running": len(running),
                # A contiguous allocator reserves prompt + max_tokens (at best) or the whole context.
                "reserved_prompt_plus_max": sum(r.num_prompt_tokens + r.max_tokens for r in running),
                "reserved_max_model_len": len(running) * eng.max_model_len,
            }
    dt = time.perf_counter() - t0
    bs = eng.pool.block_size
    return {
        "output_tokens": sum(outs), "seconds": round(dt, 2), "tok_per_s": round(sum(outs) / dt, 1),
        "kv_util_paged": round(peak["real_tokens"] / (peak["used_blocks"] * bs), 4),
        "kv_util_contiguous_prompt_plus_max": round(peak["real_tokens"] / peak["reserved_prompt_plus_max"], 4),
        "kv_util_contiguous_max_model_len": round(peak["real_tokens"] / peak["reserved_max_model_len"], 4),
        "peak_running": peak["running"], "steps": eng.stats["steps"],
    }


def load_hf(hf_dir: str, dtype):
    # From plain safetensors: transformers keeps GGUF weights packed, which would slow it down.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()


def bench_hf_static(hf, prompts, outs, batch=16) -> dict:
    useful, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, ns = prompts[i:i + batch], outs[i:i + batch]
            width = max(map(len, ps))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns),
                        do_sample=False, pad_token_id=0)
            useful += sum(ns)
    dt = time.perf_counter() - t0
    return {"output_tokens": useful, "seconds": round(dt, 2), "tok_per_s": round(useful / dt, 1)}


def bench_batch1(llm: LLM, hf, prompt, n=128) -> dict:
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate([prompt], p)[0]
    decode_s = time.perf_counter() - t0 - (out.metrics.first_token_time - out.metrics.arrival_time)
    ours = (n - 1) / decode_s
    res = {"quantpipe_decode_tok_per_s": round(ours, 1)}
    if hf is not None:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            hf_decode = (n - 1) / (time.perf_counter() - t0 - first)
        res.update(hf_decode_tok_per_s=round(hf_decode, 1), ratio=round(ours / hf_decode, 2))
    return res


def bench_prefix_ttft(dtype: str, system_ids, users, on: bool) -> dict:
    llm = LLM(dtype=dtype, device="cpu", enable_prefix_caching=on)
    ttfts = []
    for u in users:  # one at a time: TTFT without queueing
        out = llm.generate([system_ids + u], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return {"prefix_caching": on, "ttft_mean_s": round(statistics.mean(ttfts[1:]), 4),
            "ttft_median_s": round(statistics.median(ttfts[1:]), 4), "first_request_s": round(ttfts[0], 4),
            "cached_tokens_last": out.metrics.num_cached_tokens}


def bench_vllm(python: str, model_dir: str, prompts, outs, dtype: str) -> dict:
    script = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():  # vLLM starts its engine in a spawned process: keep the work under __main__
    d = json.load(open(sys.argv[1]))
    llm = LLM(model=sys.argv[2], dtype=sys.argv[3], max_num_seqs=16, max_model_len=2048, seed=0)
    ps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in d["outs"]]
    llm.generate([TokensPrompt(prompt_token_ids=d["prompts"][0])], SamplingParams(max_tokens=4))
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in d["prompts"]], ps)
    dt = time.perf_counter() - t
    out = {"output_tokens": sum(d["outs"]), "seconds": round(dt, 2), "tok_per_s": round(sum(d["outs"]) / dt, 1)}
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
'''
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "w.json")
        json.dump({"prompts": prompts, "outs": outs}, open(data, "w"))
        code = os.path.join(tmp, "run.py")
        open(code, "w").write(script)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
        proc = subprocess.run([python, code, data, model_dir, dtype], capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": proc.stderr[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    ap.add_argument("--only", default="throughput,batch1,prefix,vllm")
    ap.add_argument("--disable-cpu-kernels", default="", metavar="NAMES",
                    help="the runtime's CPU kernels to turn off (runtime/model/cpu_kernels.py)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    torch_dtype = getattr(torch, args.dtype)
    llm = LLM(dtype=args.dtype, device="cpu", disable_cpu_kernels=args.disable_cpu_kernels)
    tok = llm.get_tokenizer()
    prompts, outs = chat_cpu(tok)
    hf_dir = export_hf(llm.engine.runner.model, tok, tempfile.mkdtemp(prefix="quantpipe-hf-"))
    log("workload", workload="chat-cpu", requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(outs), torch_threads=torch.get_num_threads(), dtype=args.dtype)
    hf = None if args.skip_hf else load_hf(hf_dir, torch_dtype)
    if "throughput" in only:
        ours = log("quantpipe_throughput", **bench_quantpipe(llm, prompts, outs))
        if hf is not None:
            ref = log("hf_static16_throughput", **bench_hf_static(hf, prompts, outs))
            log("throughput_ratio", quantpipe_over_hf=round(ours["tok_per_s"] / ref["tok_per_s"], 2))
    if "vllm" in only and args.vllm_python:
        log("vllm_cpu_throughput", **bench_vllm(args.vllm_python, hf_dir, prompts, outs, args.dtype))
    if "batch1" in only:
        log("batch1_decode", **bench_batch1(llm, hf, prompts[0][:64]))
    if "prefix" in only:
        from pydoc_data.topics import topics

        text = " ".join(topics[k] for k in sorted(topics))
        ids = tok.encode(text, add_special_tokens=False)
        system, users = ids[:1024], [ids[2000 + 40 * i: 2000 + 40 * i + 32] for i in range(33)]
        on = log("prefix_ttft", **bench_prefix_ttft(args.dtype, system, users, True))
        off = log("prefix_ttft", **bench_prefix_ttft(args.dtype, system, users, False))
        log("prefix_ttft_ratio", off_over_on=round(off["ttft_mean_s"] / on["ttft_mean_s"], 1))


if __name__ == "__main__":
    main()
