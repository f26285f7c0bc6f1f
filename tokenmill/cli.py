"""The `tokenmill` command: generate, serve, bench."""

from __future__ import annotations

import argparse
import sys

from tokenmill.bench.cli import register as register_bench
from tokenmill.server.cli import register as register_serve


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt offline and print the completion")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-hf", help="write a model (e.g. a GGUF) as an HF folder")
    p.add_argument("out_dir")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.model.export import export_hf
    from tokenmill.model.loader import load_model

    model, _, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    print(export_hf(model, tokenizer, args.out_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_export(sub)
    register_serve(sub)
    register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
