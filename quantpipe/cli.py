"""The `quantpipe` command: one subcommand (or group) per stage, plus the runtime's own."""

from __future__ import annotations

import logging
import sys

import click

from quantpipe import __version__
from quantpipe.calibrate.cli import calibrate_command
from quantpipe.eval.cli import eval_command, lm_eval_command
from quantpipe.gate_cli import gate_command
from quantpipe.kernels.cli import kernels_group
from quantpipe.pipeline.cli import pipeline_command
from quantpipe.quantize.cli import quantize_command
from quantpipe.registry.cli import canary_command, promote_command, publish_command, registry_group, rollback_command
from quantpipe.runtime.bench.cli import bench
from quantpipe.runtime.cli import export_hf, generate
from quantpipe.runtime.server.cli import make_serve_command
from quantpipe.runtime.utils import run_click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="quantpipe")
def cli() -> None:
    """Quantize LLMs calibrated on production traffic; verify, gate and publish them.

    Stages: calibrate, quantize, kernels build, eval, gate, publish (promote, rollback); `pipeline` runs them all.
    Runtime: serve, generate, bench, export-hf.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


cli.add_command(calibrate_command)
cli.add_command(quantize_command)
cli.add_command(eval_command)
cli.add_command(lm_eval_command)
cli.add_command(gate_command)
cli.add_command(kernels_group)
cli.add_command(pipeline_command)
for command in (publish_command, promote_command, rollback_command, canary_command, registry_group):
    cli.add_command(command)


def _registry_model(uri: str) -> str:
    """models:/NAME@ALIAS or /VERSION -> the local artifact folder (for `quantpipe serve`)."""
    from quantpipe.registry import RegistryError, resolve_model_uri

    try:
        return resolve_model_uri(uri)
    except RegistryError as e:
        raise ValueError(str(e)) from None


cli.add_command(make_serve_command(resolve_model=_registry_model))
cli.add_command(generate)
cli.add_command(export_hf)
cli.add_command(bench)


def main(argv: list[str] | None = None) -> int:
    """The console script: run the CLI and return its exit code."""
    return run_click(cli, argv, "quantpipe")


if __name__ == "__main__":
    sys.exit(main())
