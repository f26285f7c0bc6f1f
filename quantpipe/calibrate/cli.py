"""`quantpipe calibrate`: a thin layer over calibrate(CalibConfig)."""

from __future__ import annotations

import sys
import time

import click

from quantpipe.calibrate.config import ALLOCATIONS, FORMATS, CalibConfig
from quantpipe.manifest import StageError


def _ints(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace("-", ",").split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


@click.command("calibrate", help="Sample stratified calibration and held-out sets from production request logs.")
@click.option("--logs", multiple=True, help="input files or globs (.gz, .zst too); repeat or list several")
@click.argument("more_logs", nargs=-1)
@click.option("--recipe", default=None, help="YAML recipe (calib_sets/recipes/*.yaml); flags override it")
@click.option("--out", default=None, help="output folder (written only when complete)")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None, help="input format [default: auto]")
@click.option("--text-field", default=None, help="generic JSONL/CSV/Parquet: the text column")
@click.option("--label-field", default=None, help="generic: a column to stratify by (strata key 'label')")
@click.option("--model", default=None, help="tokenizer and chat template [default: SmolLM2-135M-Instruct]")
@click.option("--strata", default=None, help="comma-separated: metadata.<key>, endpoint, model, label, length, cluster")
@click.option("--size", type=int, default=None, help="calibration samples [default: 512]")
@click.option("--heldout-size", type=int, default=None, help="held-out samples [default: 256]")
@click.option("--min-per-stratum", type=int, default=None, help="floor per stratum [default: 16]")
@click.option("--allocation", type=click.Choice(ALLOCATIONS), default=None, help="[default: proportional]")
@click.option("--seed", type=int, default=None, help="[default: 0]")
@click.option("--min-tokens", type=int, default=None, help="drop shorter texts [default: 16]")
@click.option("--include-status", default=None, help="statuses kept, comma-separated [default: ok]")
@click.option("--max-bad-lines", type=float, default=None, help="fraction of malformed lines tolerated [default: 0.01]")
@click.option("--near-dup-threshold", type=float, default=None, help="Jaccard similarity that counts as a "
              "near-duplicate [default: 0.8]")
@click.option("--length-edges", default=None, help="token-length bucket edges [default: 64,128,256,512,1024,2048]")
@click.option("--cluster-k", default=None, help="k range for cluster strata, e.g. 2-12")
@click.option("--allow-smaller", is_flag=True, default=None, help="take what is left when it is less than asked")
@click.option("--overwrite", is_flag=True, default=None, help="replace an existing --out folder")
@click.option("--workers", type=int, default=None, help="processes for the first pass [default: one per core for "
              "logs over 32 MiB]; the output does not depend on it")
@click.option("--ray", default=None, envvar="RAY_ADDRESS", show_envvar=True,
              help="a Ray cluster's address: the logs are read and featurized there through Ray Data "
                   "(pip install 'quantpipe[ray]'); the sets are the same byte for byte")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def calibrate_command(logs, more_logs, recipe, fmt, no_progress, **flags) -> int:
    from quantpipe.calibrate.stage import calibrate

    flags["format"] = fmt
    for name in ("allow_smaller", "overwrite"):  # an absent flag must not override the recipe
        flags[name] = flags[name] or None
    flags["length_edges"] = _ints(flags["length_edges"])
    flags["cluster_k"] = _ints(flags["cluster_k"])
    if logs or more_logs:
        flags["logs"] = [p for item in logs + more_logs for p in item.split(",") if p]
    t0 = time.perf_counter()
    try:
        cfg = CalibConfig.from_recipe(recipe, **flags) if recipe else CalibConfig(
            **{k: v for k, v in flags.items() if v is not None})
        result = calibrate(cfg, progress=not no_progress and sys.stderr.isatty())
    except StageError as e:
        click.echo(f"quantpipe calibrate: {e}", err=True)
        return 2
    m = result.manifest
    click.echo(f"{m['counts']['calib']} calibration + {m['counts']['heldout']} held-out texts from "
               f"{m['counts']['cleaned']} cleaned records ({m['lines_read']} lines) in {time.perf_counter() - t0:.1f}s")
    dropped = {k: v for k, v in m["dropped"].items() if v}
    pii = {k: v for k, v in m["pii_scrubbed"].items() if v}
    click.echo(f"dropped: {dropped or 'nothing'}; PII scrubbed: {pii or 'none'}")
    for s in m["strata"]:
        flag = "  (under-covered)" if s["under_covered"] else ""
        click.echo(f"  {s['name']:<60} log {s['log_share']:6.1%}  calib {s['calib_count']:4d} "
                   f"({s['calib_share']:6.1%})  held-out {s['heldout_count']:4d}{flag}")
    click.echo(f"wrote {result.path}/calib.jsonl, heldout.jsonl, manifest.json, coverage.html")
    return 0
