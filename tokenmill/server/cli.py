"""`tokenmill serve [MODEL]` and `python -m tokenmill.server`."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: from MODEL)")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--device", default="auto")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--kv-cache-memory", default=None, help="bytes ('2GiB') or a fraction of free memory (0.5)")
    e.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    e.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("server")
    s.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable)")
    s.add_argument("--api-key-file", default=None, help="file with one accepted key per line")
    s.add_argument("--protect-metrics", action="store_true", help="require a key on /metrics and /health too")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds; 0 disables")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    s.add_argument("--max-queued-requests", type=int, default=None)
    s.add_argument("--max-queued-tokens", type=int, default=None)
    s.add_argument("--rate-limit-rps", type=float, default=None, help="requests per second per key")
    s.add_argument("--rate-limit-tpm", type=float, default=None, help="prompt+max tokens per minute per key")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _kv_memory(value: str | None):
    if value is None:
        return None
    try:
        f = float(value)
    except ValueError:
        return value  # "2GiB": the engine parses it
    return f if 0 < f <= 1 else int(f)


def _api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key)
    if args.api_key_file:
        with open(args.api_key_file) as f:
            keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if os.environ.get("TOKENMILL_API_KEY"):
        keys.append(os.environ["TOKENMILL_API_KEY"])
    return keys


def run(args: argparse.Namespace) -> int:
    from tokenmill.llm_engine import EngineArgs
    from tokenmill.server.app import create_app
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.runner import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model_flag or args.model
    try:
        config = ServerConfig(
            host=args.host, port=args.port, served_model_name=args.served_model_name, api_keys=_api_keys(args),
            protect_metrics=args.protect_metrics, request_timeout=args.request_timeout or None,
            drain_timeout=args.drain_timeout, max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens, rate_limit_rps=args.rate_limit_rps,
            rate_limit_tpm=args.rate_limit_tpm, max_body_bytes=args.max_body_bytes, log_level=args.log_level,
        )
        engine = _load_off_main_thread(EngineArgs(
            model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, kv_cache_memory=_kv_memory(args.kv_cache_memory),
            enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        ))
    except (ValueError, OSError) as e:
        print(f"tokenmill serve: {e}", file=sys.stderr)
        return 2
    names = model_names(model, args.served_model_name)
    # The engine thread holds the GIL through the Python parts of each step; a short
    # switch interval bounds how long the event loop waits for it (the "convoy" that
    # otherwise adds ~5 ms per socket operation under load) at a small cost to steps.
    sys.setswitchinterval(float(os.environ.get("TOKENMILL_SWITCH_INTERVAL_MS", "0.5")) / 1000)
    # Loading leaves ~300k long-lived objects (tokenizer, GGUF metadata); a full GC pass
    # over them stalls the event loop ~150 ms. Freeze them out of the collector's view.
    gc.collect()
    gc.freeze()
    return serve(create_app(engine, config, names), config)


def _load_off_main_thread(engine_args):
    """Build the engine in a short-lived thread so the main thread never runs torch ops.

    Once the main thread has used PyTorch's CPU thread pool, steps run by the engine
    thread were ~25% slower (benchmarks/bench_engine_thread.py: load-main vs load-other).
    """
    import threading

    from tokenmill.llm_engine import LLMEngine

    result: dict[str, object] = {}

    def load() -> None:
        try:
            result["engine"] = LLMEngine(engine_args)
        except BaseException as e:  # re-raised on the main thread
            result["error"] = e

    loader = threading.Thread(target=load, name="tokenmill-load")
    loader.start()
    loader.join()
    if "error" in result:
        raise result["error"]
    return result["engine"]


def model_names(model: str | None, served: str | None) -> list[str]:
    """Names a request's `model` may use; the first is reported back."""
    default = "SmolLM2-135M-Instruct"
    names = []
    if served:
        names.append(served)
    if model:
        base = os.path.basename(os.path.normpath(model))
        names += [model, base, base.removesuffix(".gguf")]
    else:
        names += [default, "HuggingFaceTB/SmolLM2-135M-Instruct"]
    return list(dict.fromkeys(names))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.server", description="OpenAI-compatible server")
    add_arguments(p)
    return run(p.parse_args(argv))
