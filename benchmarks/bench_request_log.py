"""CPU cost of the production request log per request, measured on its own.

    .venv/bin/python benchmarks/bench_request_log.py [--lines 20000]

Builds chat-cpu-sized records (a ~1,000-character prompt, a ~500-character reply, labels)
the way the server does (`log_record`), hands them to a RequestLog writing to a temporary
file, and reports microseconds per line on the calling thread (what the event loop pays)
and in total (process CPU time, writer thread included). Divided by the CPU time the
server spends per request, that bounds the log's share of throughput from above.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

from quantpipe.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quantpipe.runtime.server.request_log import RequestLog, RequestLogConfig, log_record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=20000)
    args = ap.parse_args()
    from pydoc_data.topics import topics

    text = " ".join(topics.values())
    body = {"messages": [{"role": "user", "content": text[:1000]}], "max_tokens": 128, "temperature": 0,
            "metadata": {"task": "docs_qa", "conversation_id": "c-123", "tenant": "acme"}}
    out = RequestOutput("chatcmpl-x", None, list(range(256)),
                        [CompletionOutput(0, text[1000:1500], list(range(128)), "length")], True,
                        RequestMetrics(1.0, 1.01, 1.2, 3.0, 32))
    responder = SimpleNamespace(delivered_text=lambda o: o.outputs[0].text, delivered_finish_reason="length")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "requests.jsonl")
        rlog = RequestLog(RequestLogConfig(path))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        caller = 0.0
        for i in range(args.lines):
            t = time.perf_counter()
            rlog.write(log_record(f"chatcmpl-{i}", time.time(), "/v1/chat/completions", "SmolLM2-135M-Instruct",
                                  "ok", body, out, None, None, responder, 2.0))
            caller += time.perf_counter() - t
        rlog.close()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        size = os.path.getsize(path)
    print(json.dumps({"lines": args.lines, "bytes_per_line": round(size / args.lines),
                      "caller_us_per_line": round(caller / args.lines * 1e6, 1),
                      "cpu_us_per_line": round(cpu / args.lines * 1e6, 1), "wall_s": round(wall, 2),
                      "written": rlog.written, "dropped": rlog.dropped}))


if __name__ == "__main__":
    main()
