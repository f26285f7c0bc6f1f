"""`quantpipe serve [MODEL]` and `python -m quantpipe.runtime.server`."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import click

from quantpipe.runtime.model.cpu_kernels import help_text as cpu_kernels_help
from quantpipe.runtime.utils import run_click


def serve_options(f):
    """The options of `quantpipe serve`, shared with `python -m quantpipe.runtime.server`."""
    opts = [
        click.argument("model", required=False, default=None),
        click.option("--model", "model_flag", default=None, help="same as the positional MODEL"),
        click.option("--host", default="127.0.0.1", show_default=True),
        click.option("--port", type=int, default=8000, show_default=True),
        click.option("--served-model-name", default=None, help="model name clients send (default: from MODEL)"),
        # engine
        click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "float32", "bfloat16", "float16"])),
        click.option("--device", default="auto", show_default=True),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--max-num-seqs", type=int, default=256, show_default=True),
        click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True),
        click.option("--max-model-len", type=int, default=None),
        click.option("--kv-cache-memory", default=None, help="bytes ('2GiB') or a fraction of free memory (0.5)"),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default="auto",
                     show_default=True, help="KV cache storage; auto: the artifact's kv_cache_scheme, else the "
                                             "model dtype"),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--disable-cpu-kernels", default="", metavar="NAMES", callback=_check_cpu_kernels,
                     help="comma-separated CPU kernels of the runtime to turn off (their layers take torch's "
                          "path): " + cpu_kernels_help()),
        # server
        click.option("--api-key", multiple=True, help="accepted Bearer key (repeatable)"),
        click.option("--api-key-file", default=None, help="file with one accepted key per line"),
        click.option("--protect-metrics", is_flag=True, help="require a key on /metrics and /health too"),
        click.option("--request-timeout", type=float, default=600.0, show_default=True, help="seconds; 0 disables"),
        click.option("--drain-timeout", type=float, default=30.0, show_default=True,
                     help="seconds to finish requests on SIGTERM"),
        click.option("--max-queued-requests", type=int, default=None),
        click.option("--max-queued-tokens", type=int, default=None),
        click.option("--rate-limit-rps", type=float, default=None, help="requests per second per key"),
        click.option("--rate-limit-tpm", type=float, default=None, help="prompt+max tokens per minute per key"),
        click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True),
        click.option("--log-level", default="info", show_default=True,
                     type=click.Choice(["critical", "error", "warning", "info", "debug"])),
        # production request log
        click.option("--request-log", default=None,
                     help="append one JSON line per request (the input of `quantpipe calibrate`)"),
        click.option("--request-log-max-bytes", type=int, default=256 << 20, show_default=True,
                     help="rotate the log past this size (0: never)"),
        click.option("--request-log-backups", type=int, default=5, show_default=True,
                     help="rotated files kept (PATH.1 ... PATH.N)"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _check_cpu_kernels(ctx, param, value: str) -> str:
    from quantpipe.runtime.model.cpu_kernels import CpuKernels

    try:
        CpuKernels.parse(value, key="--disable-cpu-kernels")
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--disable-cpu-kernels: ")) from None
    return value


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
    if os.environ.get("QUANTPIPE_API_KEY"):
        keys.append(os.environ["QUANTPIPE_API_KEY"])
    return keys


def run(args: argparse.Namespace, resolve_model=None) -> int:
    """Serve until stopped. `resolve_model` turns a MODEL that is not a path (a registry URI,
    models:/NAME@ALIAS) into one; the quantpipe CLI passes its registry's resolver, and the
    runtime itself knows no registry."""
    from quantpipe.runtime.llm_engine import EngineArgs
    from quantpipe.runtime.server.app import create_app
    from quantpipe.runtime.server.config import ServerConfig
    from quantpipe.runtime.server.request_log import RequestLogConfig
    from quantpipe.runtime.server.runner import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    model = args.model_flag or args.model
    if model and model.startswith("models:/"):  # a registry URI: serve the artifact it names
        if resolve_model is None:
            print(f"quantpipe serve: MODEL {model}: registry URIs are resolved by `quantpipe serve`; this entry "
                  f"point serves a path (GGUF, HF folder or artifact)", file=sys.stderr)
            return 2
        try:
            model = resolve_model(model)
        except ValueError as e:
            print(f"quantpipe serve: {e}", file=sys.stderr)
            return 2
    try:
        config = ServerConfig(
            host=args.host, port=args.port, served_model_name=args.served_model_name, api_keys=_api_keys(args),
            protect_metrics=args.protect_metrics, request_timeout=args.request_timeout or None,
            drain_timeout=args.drain_timeout, max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens, rate_limit_rps=args.rate_limit_rps,
            rate_limit_tpm=args.rate_limit_tpm, max_body_bytes=args.max_body_bytes, log_level=args.log_level,
            request_log=RequestLogConfig(args.request_log, args.request_log_max_bytes, args.request_log_backups)
            if args.request_log else None,
        )
        engine = _load_off_main_thread(EngineArgs(
            model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, kv_cache_memory=_kv_memory(args.kv_cache_memory),
            kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
            disable_cpu_kernels=args.disable_cpu_kernels,
        ))
    except (ValueError, OSError) as e:
        print(f"quantpipe serve: {e}", file=sys.stderr)
        return 2
    names = model_names(model, args.served_model_name)
    try:
        app = create_app(engine, config, names)
    except OSError as e:  # the request log could not be opened
        print(f"quantpipe serve: --request-log {args.request_log}: {e.strerror or e}", file=sys.stderr)
        return 2
    # The engine thread holds the GIL through the Python parts of each step; a short
    # switch interval bounds how long the event loop waits for it (the "convoy" that
    # otherwise adds ~5 ms per socket operation under load) at a small cost to steps.
    sys.setswitchinterval(float(os.environ.get("QUANTPIPE_SWITCH_INTERVAL_MS", "0.5")) / 1000)
    # Loading leaves ~300k long-lived objects (tokenizer, GGUF metadata); a full GC pass
    # over them stalls the event loop ~150 ms. Freeze them out of the collector's view.
    gc.collect()
    gc.freeze()
    return serve(app, config)


def _load_off_main_thread(engine_args):
    """Build the engine in a short-lived thread so the main thread never runs torch ops.

    Once the main thread has used PyTorch's CPU thread pool, steps run by the engine
    thread were ~25% slower (benchmarks/bench_engine_thread.py: load-main vs load-other).
    """
    import threading

    from quantpipe.runtime.llm_engine import LLMEngine

    result: dict[str, object] = {}

    def load() -> None:
        try:
            result["engine"] = LLMEngine(engine_args)
        except BaseException as e:  # re-raised on the main thread
            result["error"] = e

    loader = threading.Thread(target=load, name="quantpipe-load")
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


def make_serve_command(resolve_model=None) -> click.Command:
    """The `serve` command; `resolve_model` as in `run`."""

    @click.command("serve", help="Run the OpenAI-compatible HTTP server.")
    @serve_options
    def serve_command(**options) -> int:
        return run(argparse.Namespace(**options), resolve_model)

    return serve_command


serve_command = make_serve_command()


def main(argv: list[str] | None = None) -> int:
    return run_click(serve_command, argv, "python -m quantpipe.runtime.server")
