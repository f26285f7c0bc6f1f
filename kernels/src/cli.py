"""`quantpipe kernels build`: verify, autotune and record the Triton kernels an artifact needs."""

from __future__ import annotations

import os
import sys

import click

from quantpipe.kernels.configs import DEFAULT_BUCKETS
from quantpipe.manifest import StageError


def _buckets(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"comma-separated positive integers, got {value!r}") from None
    if not out or any(b < 1 or b > 4096 for b in out) or sorted(set(out)) != out:
        raise click.BadParameter(f"increasing batch sizes in [1, 4096], got {value!r}")
    return out


@click.group("kernels")
def kernels_group() -> None:
    """Triton kernels matched to an artifact's format."""


@kernels_group.command("build")
@click.argument("artifact")
@click.option("--device", default="cuda", show_default=True, help="the CUDA device to tune on")
@click.option("--batch-buckets", default=",".join(map(str, DEFAULT_BUCKETS)), show_default=True,
              help="batch sizes (rows) a config is chosen for")
@click.option("--interpret", is_flag=True,
              help="verify every case in Triton's CPU interpreter on reduced shapes; tunes and writes nothing")
def build_command(artifact, device, batch_buckets, interpret) -> int:
    """Verify each kernel the ARTIFACT needs against its torch reference, autotune it per batch bucket,
    and write kernels.json into the artifact (only when every case passed)."""
    try:
        buckets = _buckets(batch_buckets)
    except click.BadParameter as e:
        click.echo(f"quantpipe kernels build: --batch-buckets: {e.message}", err=True)
        return 2
    if interpret:
        # Triton decides when a kernel module is imported whether @triton.jit interprets.
        if "quantpipe.kernels.mixed_gemm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            click.echo("quantpipe kernels build: --interpret: the kernels were already imported without "
                       "TRITON_INTERPRET=1 in this process", err=True)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    from quantpipe.kernels.build import VerificationError, build

    try:
        report = build(artifact, device, buckets, interpret, echo=click.echo)
    except VerificationError as e:
        click.echo(f"quantpipe kernels build: {e}; no kernels.json written", err=True)
        return 1
    except StageError as e:
        click.echo(f"quantpipe kernels build: {e}", err=True)
        return 2
    n = len(report["cases"])
    if interpret:
        click.echo(f"verified {n} matmul cases and {len(report.get('attention', []))} attention cases in the "
                   f"interpreter; {len(report['unsupported'])} without a kernel; nothing written (tuning needs CUDA)")
    else:
        click.echo(f"kernels.json: {n} cases tuned for {report['device']['name']} -> {artifact}")
    return 0
