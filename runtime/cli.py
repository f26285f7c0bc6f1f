"""The runtime's own commands: `quantpipe generate` and `quantpipe export-hf`.

`serve` lives in server/cli.py and `bench` in bench/cli.py; quantpipe/cli.py gathers them.
"""

from __future__ import annotations

import click

MODEL_HELP = "GGUF file or HF folder (default: SmolLM2-135M-Instruct)"


@click.command("generate", help="Complete one prompt offline and print the completion.")
@click.argument("prompt")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--chat", is_flag=True, help="apply the model's chat template")
def generate(prompt: str, model: str | None, max_tokens: int, temperature: float, seed: int | None,
             dtype: str, device: str, chat: bool) -> None:
    from quantpipe.runtime import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    else:
        out = llm.generate(prompt, params)[0]
    click.echo(out.outputs[0].text)


@click.command("export-hf", help="Write a model (e.g. a GGUF) as an HF folder.")
@click.argument("out_dir")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
def export_hf(out_dir: str, model: str | None, dtype: str) -> None:
    import torch

    from quantpipe.runtime.model.export import export_hf as export
    from quantpipe.runtime.model.loader import load_model

    loaded, _, tokenizer = load_model(model, getattr(torch, dtype))
    click.echo(export(loaded, tokenizer, out_dir))
