"""`quantpipe quantize`: a thin layer over quantize(model, QuantConfig, calib)."""

from __future__ import annotations

import click

from quantpipe.manifest import StageError
from quantpipe.quantize.config import CLIPS, KV_CACHES, KV_STRATEGIES, LEARN_DTYPES, METHODS, SCHEMES, QuantConfig


@click.command("quantize", help="Quantize a model's weights into a compressed-tensors artifact.")
@click.argument("model", required=False, default=None)
@click.option("--scheme", type=click.Choice(SCHEMES), default="W4A16", show_default=True)
@click.option("--group-size", type=int, default=None,
              help="32, 64 or 128 [default: W4A16 128 if it divides every layer, else 64, else 32; W8 per channel]")
@click.option("--symmetric/--asymmetric", default=True, show_default=True)
@click.option("--method", type=click.Choice(METHODS), default="rtn", show_default=True)
@click.option("--clip", type=click.Choice(CLIPS), default=None,
              help="grid range: mse searches it per group (RTN: rounding error; GPTQ: the layer's output "
                   "error) [default: mse for GPTQ, minmax otherwise; autoround learns its own]")
@click.option("--dampening", type=float, default=0.01, show_default=True, help="GPTQ: x mean Hessian diagonal")
@click.option("--act-order/--no-act-order", default=True, show_default=True,
              help="GPTQ: columns by decreasing Hessian diagonal (groups stay in order: actorder 'weight')")
@click.option("--iters", type=int, default=200, show_default=True,
              help="autoround: sign-gradient steps per decoder layer (step size 1 / iters)")
@click.option("--batch-size", type=int, default=8, show_default=True,
              help="autoround: calibration sequences per step")
@click.option("--learn-dtype", type=click.Choice(LEARN_DTYPES), default="auto",
              show_default=True, help="autoround: dtype of its steps (auto: bfloat16 on CPUs with native bf16)")
@click.option("--calib", default=None, help="calibration set folder (quantpipe calibrate) or a text file")
@click.option("--calib-samples", type=int, default=128, show_default=True)
@click.option("--calib-seq-len", type=int, default=512, show_default=True)
@click.option("--quantize-lm-head", is_flag=True, help="also quantize lm_head (untied models only)")
@click.option("--bits-budget", type=float, default=None,
              help="mixed: average bits per quantized weight, scales and zero points included (at least the "
                   "smallest candidate's)")
@click.option("--sensitivity-samples", type=int, default=4, show_default=True,
              help="mixed: calibration sequences each layer's sensitivity (KL) is measured on")
@click.option("--sensitivity-tokens", type=int, default=128, show_default=True,
              help="mixed: tokens of each of those sequences")
@click.option("--mixed-bits", default=",".join(map(str, QuantConfig.mixed_bits)), show_default=True,
              metavar="BITS", help="mixed: bit widths a layer may take besides bf16 (2-8; below 8 by group, 8 per "
                                   "channel), e.g. 3,4,6,8")
@click.option("--mixed-group-sizes", default=None, metavar="SIZES",
              help="mixed: group sizes of the widths below 8, each where it divides the layer's input "
                   "[default: --group-size, or W4A16's default for the model]")
@click.option("--sensitivity-from", default=None, metavar="ARTIFACT",
              help="mixed: reuse this earlier mixed artifact's sensitivity table when its manifest shows it was "
                   "measured on the same model, sequences and precisions (else measure again)")
@click.option("--smoothquant-alpha", type=float, default=None,
              help="W8A8: SmoothQuant with this migration strength (0 < alpha < 1, e.g. 0.5) [default: off; W8A8 "
                   "rotates instead]")
@click.option("--no-smoothquant", is_flag=True, help="W8A8 without SmoothQuant (the default)")
@click.option("--kv-cache", type=click.Choice(KV_CACHES), default="none", show_default=True,
              help="KV cache the artifact is served with (8-bit)")
@click.option("--kv-cache-strategy", type=click.Choice(KV_STRATEGIES), default="token", show_default=True,
              help="token: a scale per token and KV head at run time; channel: static, one per KV head and "
                   "channel, from --calib")
@click.option("--calibrate-all-experts", is_flag=True,
              help="MoE, GPTQ/AWQ: each expert's Hessian from every calibration token of its layer, not only the "
                   "ones routed to it")
@click.option("--rotate", "rotations", default=None, metavar="R1,R4|none",
              help="orthogonal rotations before quantizing: R1 (residual stream), R4 (down projection input, "
                   "online Hadamard); rtn, gptq and autoround [default: W8A8 R1,R4 as far as the model takes them, "
                   "otherwise none]")
@click.option("--hadamard-block-size", type=int, default=128, show_default=True,
              help="R4: size of its Hadamard blocks (a power of two dividing the MLP's intermediate size)")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="scales and unquantized tensors")
@click.option("--max-memory", default=None, metavar="SIZE",
              help="quantize one decoder layer at a time within this resident memory (e.g. 12GB, 1536MiB), "
                   "for models larger than memory: rtn, gptq, awq, autoround; the same files as without it "
                   "at the same --max-shard-size")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="safetensors shard size of the artifact (a single tensor or layer larger than it gets a file "
                   "of its own) [default: 5GB; with --max-memory at most 1/8 of it]")
@click.option("--out", required=True, help="artifact folder (written only when complete)")
@click.option("--overwrite", is_flag=True, help="replace an existing --out folder")
def quantize_command(model, calib, out, overwrite, sensitivity_from, max_memory, max_shard_size, **options) -> int:
    from quantpipe.quantize.stage import quantize
    from quantpipe.quantize.stream import parse_size

    if options.pop("no_smoothquant"):
        options["smoothquant_alpha"] = None
    try:
        cfg = QuantConfig(**options)
        sizes = {k: None if v is None else parse_size(v, f"--{k.replace('_', '-')}")
                 for k, v in (("max_memory", max_memory), ("max_shard_size", max_shard_size))}
        art = quantize(model, cfg, calib, out, overwrite=overwrite, sensitivity_from=sensitivity_from, **sizes)
    except StageError as e:
        click.echo(f"quantpipe quantize: {e}", err=True)
        return 2
    m = art.manifest
    kv = f", KV cache {cfg.kv_cache}" if cfg.kv_cache != "none" else ""
    click.echo(f"{m['weights']} ({m['method']}){kv} over {len(m['layers'])} linears: {m['bytes']['ratio']:.1%} of "
               f"their bf16 bytes; {sum(m['time_s'].values()):.1f}s -> {art.path}")
    return 0
