"""The distribution: one `quantpipe` namespace over the design's folders, and its CLI."""

from __future__ import annotations

import fnmatch
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


def test_hf_transformers_imports_from_the_repository_root():
    """`python -m ...` from a checkout puts the root first on sys.path; `kernels/` there is not
    a package, so Hugging Face's `kernels` (which transformers' model code imports) is found,
    without quantpipe imported first."""
    code = ("import transformers.modeling_utils, kernels, importlib.util\n"
            f"assert not kernels.__file__.startswith({os.path.join(ROOT, 'kernels')!r}), kernels.__file__\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,"
            " num_attention_heads=2, vocab_size=64))\n"
            "import quantpipe.kernels as ours\n"
            "assert ours.__file__ != kernels.__file__\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import quantpipe

    assert "sys.path" not in open(quantpipe.__file__).read()  # no search-path rewriting on import


def _data_files() -> dict[str, str]:
    """Every data file the design's folders hold -> its path inside the wheel."""
    out = {}
    for folder, pkg, patterns in (("evals", "quantpipe/evals", ("*.yaml", "*_yaml", "*.json", "*.json.gz", "*.md")),
                                  ("runtime/model/csrc", "quantpipe/runtime/model/csrc", ("*.cpp",))):
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if any(fnmatch.fnmatch(f, p) for p in patterns):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)
                    out[os.path.join(folder, rel)] = f"{pkg}/{rel}"
    return out


@pytest.mark.slow
def test_wheel_maps_folders_to_subpackages_and_holds_every_data_file(built_wheel, tmp_path):
    wheel, site, build_log = built_wheel
    assert "would be ignored" not in build_log and "absent from the `packages`" not in build_log, build_log
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in SUBPACKAGES + ("quantpipe.runtime.server", "quantpipe.runtime.engine", "quantpipe.runtime.model"):
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert top == {"quantpipe"}, top
    data = _data_files()
    assert "evals/gates/default.yaml" in data and "runtime/model/csrc/packed_linear.cpp" in data
    missing = sorted(src for src, inside in data.items() if inside not in names)
    assert not missing, missing
    # Installed on its own (no editable finder in front), the wheel's copy is the one imported.
    code = ("import quantpipe.runtime, quantpipe.kernels, quantpipe.evals, importlib.util\n"
            f"assert quantpipe.runtime.__file__.startswith({str(site)!r}), quantpipe.runtime.__file__\n"
            "from quantpipe.runtime import LLM, SamplingParams\n"
            "assert importlib.util.find_spec('runtime') is None\n")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, env={**os.environ, "PYTHONPATH": str(site)})


def test_cli_lists_the_commands():
    from click.testing import CliRunner

    from quantpipe.cli import cli

    out = CliRunner().invoke(cli, ["--help"]).output
    for command in ("calibrate", "quantize", "kernels", "eval", "lm-eval", "gate", "publish", "serve", "generate", "bench",
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
