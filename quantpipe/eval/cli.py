"""`quantpipe eval`: a thin layer over evaluate(candidates, calib, out)."""

from __future__ import annotations

import click

from quantpipe import distributed
from quantpipe.manifest import StageError


@click.command("eval", help="A/B candidate artifacts against their baseline: quality and latency, one report.")
@click.option("--candidate", "candidates", multiple=True, required=True,
              help="artifact folder (repeat the option to compare several in one report)")
@click.option("--calib", required=True, help="calibration set folder (quantpipe calibrate): its held-out set")
@click.option("--baseline", default=None, help="source model [default: the default model]")
@click.option("--suite", default=None, help="suite YAML [default: evals/suites/default.yaml]")
@click.option("--quality-only", is_flag=True, help="skip the latency suite (verdict scope: quality)")
@click.option("--latency-only", is_flag=True, help="skip the quality suite (verdict scope: latency)")
@click.option("--bootstrap", type=int, default=None, help="bootstrap replicates per CI [default: the suite's]")
@click.option("--out", required=True, help="report folder (written only when complete)")
@click.option("--overwrite", is_flag=True, help="replace an existing --out folder")
@distributed.cli_options("held-out shards, each model's tasks and the latency A/B run there as Ray tasks; "
                         "the report's numbers are the same")
def eval_command(candidates, calib, baseline, suite, quality_only, latency_only, bootstrap, out, overwrite,
                 ray, ray_cpus, ray_gpus) -> int:
    from quantpipe.eval.stage import evaluate
    from quantpipe.eval.suite import EvalSuite

    try:
        if quality_only and latency_only:
            raise StageError("--quality-only and --latency-only exclude each other")
        s = EvalSuite.load(suite)
        if bootstrap is not None:
            s.quality["bootstrap"] = bootstrap
            s.validate()
        scope = "quality" if quality_only else "latency" if latency_only else "full"
        report = evaluate(list(candidates), calib, out, baseline, s, scope, overwrite, ray=ray,
                          resources=distributed.TaskResources(num_cpus=ray_cpus, num_gpus=ray_gpus))
    except StageError as e:
        click.echo(f"quantpipe eval: {e}", err=True)
        return 2
    for c in report["candidates"]:
        q, lat = c.get("quality"), c.get("latency")
        line = f"{c['name']}: {c['weights']}"
        if q:
            line += (f", ppl {q['ppl_delta_pct']['point']:+.2f}% [{q['ppl_delta_pct']['ci_lower']:+.2f}, "
                     f"{q['ppl_delta_pct']['ci_upper']:+.2f}], KL {q['kl_mean']['point']:.4f}, "
                     f"top-1 {q['top1_agreement']['point']:.1%}")
        if lat and lat.get("tpot_p50_ratio"):
            line += f", TPOT P50 x{lat['tpot_p50_ratio']['point']:.2f}"
        click.echo(line)
    click.echo(f"report -> {out}/report.json, {out}/report.html")
    return 0


@click.command("lm-eval", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               help="lm-evaluation-harness's own command line (`lm-eval --help` lists its options) with the "
                    "`quantpipe` model registered (--model quantpipe --model_args pretrained=ARTIFACT,dtype=float32) "
                    "and the shipped tasks (quantpipe_bigbench_*) on its --include_path unless one is given. "
                    "Stock `lm_eval` finds no model outside its own list, hence this entry point.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_command(args) -> int:
    import sys

    from lm_eval.__main__ import cli_evaluate

    import quantpipe.eval.lm_eval_model  # noqa: F401 - registers the `quantpipe` model
    from quantpipe.eval.lm_eval_suite import TASKS_DIR

    argv = list(args)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
    return 0
