"""`quantpipe eval`: a thin layer over evaluate(candidates, calib, out)."""

from __future__ import annotations

import click

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
def eval_command(candidates, calib, baseline, suite, quality_only, latency_only, bootstrap, out, overwrite) -> int:
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
        report = evaluate(list(candidates), calib, out, baseline, s, scope, overwrite)
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
