"""The runtime's CPU kernels are turned off by an engine argument, named in `serve --help`."""

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from quantpipe.runtime.model.cpu_kernels import CPU_KERNELS, CpuKernels


def test_names_are_parsed_from_a_string_or_a_list_and_unknown_ones_refused():
    assert CpuKernels.parse(None).disabled == frozenset()
    assert CpuKernels.parse("").disabled == frozenset()
    assert CpuKernels.parse(" attention, packed ").disabled == {"attention", "packed"}
    assert CpuKernels.parse(["int8", "prepack,blocked-gemm"]).disabled == {"int8", "prepack", "blocked-gemm"}
    off = CpuKernels.parse("attention")
    assert not off.enabled("attention") and off.enabled("packed")
    with pytest.raises(ValueError, match=r"disable_cpu_kernels: unknown CPU kernel 'atention'; choose from attention, "):
        CpuKernels.parse("atention")
    with pytest.raises(KeyError):
        off.enabled("nope")


def test_the_engine_with_every_cpu_kernel_off_runs_torchs_path_and_generates():
    from quantpipe.runtime import LLM, SamplingParams
    from quantpipe.runtime.llm_engine import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match="unknown CPU kernel 'fast'"):
        LLMEngine(EngineArgs(dtype="float32", device="cpu", disable_cpu_kernels="fast"))
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory="64MiB",
              disable_cpu_kernels=",".join(CPU_KERNELS))
    runner = llm.engine.runner
    assert runner.decode_kernel is None
    assert type(runner.model.lm_head) is nn.Linear  # not row-blocked
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_serve_help_lists_every_cpu_kernel_and_a_bad_name_is_a_usage_error():
    from quantpipe.cli import cli

    text = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=400).output
    assert "--disable-cpu-kernels" in text
    assert all(f"{name}:" in text for name in CPU_KERNELS)
    res = CliRunner().invoke(cli, ["serve", "--disable-cpu-kernels", "packd"])
    assert res.exit_code == 2
    assert "--disable-cpu-kernels" in res.output and "unknown CPU kernel 'packd'" in res.output
    assert "Traceback" not in res.output


def test_a_turned_off_kernel_leaves_its_quantized_layers_to_torch():
    from quantpipe.formats.artifact import QuantWeight
    from quantpipe.runtime.model.quantized import swap_linears

    qw = QuantWeight(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1), None, 8, None)
    model = nn.Sequential(nn.Linear(64, 8, bias=False))
    chosen = swap_linears(model, {"0": qw}, torch.float32, torch.device("cpu"), cpu_kernels=CpuKernels.parse("packed"))
    assert chosen == {"0": "dequant"}


def _load_in_a_new_process(**env: str) -> subprocess.CompletedProcess:
    code = "from quantpipe.runtime.model.cpu_attention import extension; print(extension() is not None)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env})


def test_the_built_kernels_load_beside_other_loaders_and_after_a_killed_build(tmp_path):
    """A process loading the built module never queues behind another one loading it (held
    mid-load here by a shared lock, as a paused process would hold it); without the `ready`
    mark, and with the `lock` file a killed torch build leaves, it builds again and loads
    (in a copy of the build, so the shared cache is left as it was)."""
    from quantpipe.runtime.model.cpu_attention import extension

    ext = extension()
    if ext is None:
        pytest.skip("no C++ compiler on this machine: the kernels are not built")
    build = Path(ext.__file__).parent
    with open(build.with_name(build.name + ".flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            proc = _load_in_a_new_process()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]
    copy = shutil.copytree(build, tmp_path / build.name)
    (copy / "ready").unlink()
    (copy / "lock").write_text("")
    proc = _load_in_a_new_process(TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]
    assert (copy / "ready").exists() and not (copy / "lock").exists()
