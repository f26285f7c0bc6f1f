"""The distribution: one `quantpipe` namespace over the design's folders, and its CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPACKAGES = ("quantpipe.runtime", "quantpipe.kernels", "quantpipe.evals")


def test_no_generic_top_level_names_outside_the_tree(tmp_path):
    """From outside the source tree, the subpackages import and the bare folder names do not."""
    code = ("import importlib, importlib.util, os\n"
            f"for name in {SUBPACKAGES!r}: importlib.import_module(name)\n"
            "for name in ('runtime', 'kernels', 'evals', 'calib_sets'):\n"
            "    spec = importlib.util.find_spec(name)\n"
            # `kernels` may be Hugging Face's package (transformers depends on it), never ours.
            f"    assert spec is None or not spec.origin.startswith(os.path.join({ROOT!r}, name)), (name, spec)\n")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)
    proc = subprocess.run([sys.executable, "-c", "import runtime"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_repository_root_on_sys_path_does_not_shadow_hf_kernels():
    """`python -m ...` from a checkout puts the root first on sys.path, where our kernels/ folder
    would stand in for Hugging Face's `kernels`, which transformers' model code imports."""
    code = ("import quantpipe, transformers.modeling_utils, kernels, quantpipe.kernels as ours\n"
            "assert kernels.__file__ != ours.__file__, kernels.__file__\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_wheel_maps_folders_to_subpackages(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), ROOT],
                   check=True, capture_output=True)
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    for pkg in SUBPACKAGES + ("quantpipe.runtime.server", "quantpipe.runtime.engine", "quantpipe.runtime.model"):
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert top == {"quantpipe"}, top
    # Installed on its own (no editable finder in front), the wheel's copy is the one imported.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(tmp_path / wheel)], check=True, capture_output=True)
    code = ("import quantpipe.runtime, quantpipe.kernels, quantpipe.evals, importlib.util\n"
            f"assert quantpipe.runtime.__file__.startswith({str(site)!r}), quantpipe.runtime.__file__\n"
            "from quantpipe.runtime import LLM, SamplingParams\n"
            "assert importlib.util.find_spec('runtime') is None\n")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, env={**os.environ, "PYTHONPATH": str(site)})


def test_cli_lists_the_commands():
    from click.testing import CliRunner

    from quantpipe.cli import cli

    out = CliRunner().invoke(cli, ["--help"]).output
    for command in ("calibrate", "quantize", "kernels", "eval", "gate", "publish", "serve", "generate", "bench",
                    "export-hf"):
        assert f"  {command} " in out, out
    bench = CliRunner().invoke(cli, ["bench", "--help"]).output
    for command in ("run", "sweep", "compare", "mock-server"):
        assert f"  {command} " in bench, bench


def test_console_script_and_usage_errors():
    exe = os.path.join(os.path.dirname(sys.executable), "quantpipe")
    proc = subprocess.run([exe, "serve", "--dtype", "int3"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--dtype" in proc.stderr and "float32" in proc.stderr


def test_make_help_lists_the_targets():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for target in ("setup", "test", "serve", "bench", "calibrate", "quantize", "kernels", "eval", "gate"):
        assert f"make {target} " in out, out
