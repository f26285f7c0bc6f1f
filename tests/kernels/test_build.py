"""`quantpipe kernels build` on real artifacts of the default model, and the runtime's use of kernels.json."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantpipe.cli import cli
from quantpipe.kernels import build as build_stage
from quantpipe.kernels import mixed_gemm
from quantpipe.kernels.configs import GemmConfig
from quantpipe.kernels.plan import PLAN_FILE, load_plan, triton_version
from quantpipe.quantize import QuantConfig, quantize
from quantpipe.runtime.model.forward import sequence_logits
from quantpipe.runtime.model.loader import load_model
from tests.model.test_parity_architectures import build as build_tiny


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def w4_artifact(tmp_path_factory):
    """The default model, W4A16 group 64 symmetric (RTN), INT8 KV cache."""
    out = tmp_path_factory.mktemp("kernels") / "w4a16-g64"
    return quantize(None, QuantConfig(scheme="W4A16", group_size=64, kv_cache="int8"), None, str(out)).path


def _run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["kernels", "build", *map(str, args)], standalone_mode=False)
    if result.exception:
        raise result.exception
    return result.return_value, result.output


def test_build_without_cuda_says_so_and_leaves_the_artifact_unchanged(w4_artifact):
    before = _tree(w4_artifact)
    proc = subprocess.run([sys.executable, "-m", "quantpipe.cli", "kernels", "build", str(w4_artifact)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "needs a CUDA device to tune" in proc.stderr and "--interpret" in proc.stderr
    assert _tree(w4_artifact) == before


def test_interpret_verifies_every_case_of_the_artifact_and_writes_nothing(w4_artifact):
    before = _tree(w4_artifact)
    code, out = _run(w4_artifact, "--interpret")
    assert code == 0, out
    # q/k/v and gate/up run fused in the runtime: four matmul shapes, and the INT8 KV decode.
    for key in ("mixed_gemm/W4A16/g64/sym/960x576", "mixed_gemm/W4A16/g64/sym/576x576",
                "mixed_gemm/W4A16/g64/sym/3072x576", "mixed_gemm/W4A16/g64/sym/576x1536",
                "paged_decode/int8/H9xKVH3xD64/block16"):
        assert f"ok  {key}" in out
    assert "verified 4 matmul cases and 1 attention cases" in out
    assert _tree(w4_artifact) == before


def test_a_wrong_scale_in_one_kernel_fails_verification(w4_artifact, monkeypatch):
    """A dequantization bug (one group's scale 5% off, in the gate/up kernel only) fails the stage."""
    real_run = build_stage.GemmCase.run

    def faulty_run(self, x, config):
        if not self.case.key.endswith("/3072x576"):
            return real_run(self, x, config)
        scale = self.scale.clone()
        scale[7, 1] *= 1.05  # the kernel gets it; the reference keeps the artifact's scale
        return mixed_gemm.mixed_gemm(x, self.packed, scale, self.zero, self.bits, self.qw.group_size,
                                     config)

    monkeypatch.setattr(build_stage.GemmCase, "run", faulty_run)
    before = _tree(w4_artifact)
    result = CliRunner().invoke(cli, ["kernels", "build", str(w4_artifact), "--interpret"], standalone_mode=False)
    assert result.return_value == 1
    assert "kernel verification failed for case mixed_gemm/W4A16/g64/sym/3072x576" in result.stderr
    assert "no kernels.json written" in result.stderr
    assert "ok  mixed_gemm/W4A16/g64/sym/960x576" in result.stdout  # the cases before it passed
    assert _tree(w4_artifact) == before


def test_a_corrupted_artifact_is_refused_naming_the_tensor(w4_artifact, tmp_path):
    art = tmp_path / "corrupt"
    shutil.copytree(w4_artifact, art)
    state = load_file(art / "model.safetensors")
    name = "model.layers.3.mlp.up_proj.weight_packed"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, art / "model.safetensors")
    result = CliRunner().invoke(cli, ["kernels", "build", str(art), "--interpret"], standalone_mode=False)
    assert result.return_value == 2
    assert name in result.output
    assert not (art / PLAN_FILE).exists()


def test_bad_buckets_are_refused():
    result = CliRunner().invoke(cli, ["kernels", "build", "x", "--batch-buckets", "4,2"], standalone_mode=False)
    assert result.return_value == 2 and "--batch-buckets" in result.output


def _plan_for(art_path: Path, device: str, capability: tuple[int, int], config: GemmConfig) -> dict:
    """kernels.json as the CUDA build writes it, for a device this machine lacks (its tuning needs one)."""
    art = build_stage.read_artifact(art_path)
    cases = [{"key": c.key, "kernel": c.kernel, "layers": c.layers, "shape": list(c.weight.q.shape),
              "buckets": {"1": {"config": config.as_dict()}, "16": {"config": config.as_dict()}}}
             for c in art.cases]
    return build_stage.plan_document(art, device, capability, [1, 16], cases, [])


def test_the_runtime_runs_the_plans_kernels_and_ignores_a_plan_for_another_device(tmp_path, caplog):
    _, src = build_tiny(tmp_path, "llama-gqa-untied-llama3-rope")
    art = quantize(src, QuantConfig(scheme="W4A16", group_size=32, symmetric=False), None,
                   str(tmp_path / "w4"), calib_token_ids=[list(range(64))]).path
    doc = _plan_for(art, "NVIDIA H200", (9, 0), GemmConfig(16, 32, 32))
    (art / PLAN_FILE).write_text(json.dumps(doc))
    plan = load_plan(art, "NVIDIA H200", (9, 0))
    assert plan is not None and len(plan.cases) == len(doc["cases"])
    with caplog.at_level(logging.WARNING, "quantpipe.kernels"):
        assert load_plan(art, "NVIDIA A100-SXM4-80GB", (8, 0)) is None
    assert "built for another setup" in caplog.text and "A100" in caplog.text
    caplog.clear()
    stale = dict(doc, triton="0.0.1")
    (art / PLAN_FILE).write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING, "quantpipe.kernels"):
        assert load_plan(art, "NVIDIA H200", (9, 0)) is None
    assert f"Triton 0.0.1, this is {triton_version()}" in caplog.text

    # With the plan imposed (on CPU: the interpreter), every quantized layer runs the Triton kernel.
    ids = list(range(3, 40))
    ref_model, _, _ = load_model(str(art), torch.float32, quant_kernel="dequant")
    model, _, _ = load_model(str(art), torch.float32, kernel_plan=plan)
    kinds = {type(m).kernel for m in model.modules() if hasattr(type(m), "kernel")}
    assert kinds == {"triton-mixed"}
    got, ref = sequence_logits(model, ids), sequence_logits(ref_model, ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_a_case_missing_from_the_plan_falls_back_and_says_so_once(tmp_path, caplog):
    _, src = build_tiny(tmp_path, "mistral")
    art = quantize(src, QuantConfig(scheme="W8A16"), None, str(tmp_path / "w8")).path
    doc = _plan_for(art, "NVIDIA H200", (9, 0), GemmConfig(16, 32, 32))
    dropped = doc["cases"].pop(0)
    (art / PLAN_FILE).write_text(json.dumps(doc))
    plan = load_plan(art, "NVIDIA H200", (9, 0))
    with caplog.at_level(logging.WARNING, "quantpipe.runtime"):
        model, _, _ = load_model(str(art), torch.float32, kernel_plan=plan)
    assert caplog.text.count(f"no Triton kernel for {dropped['key']}") == 1
    kinds = [type(m).kernel for m in model.modules() if hasattr(type(m), "kernel")]
    fallback = [k for k in kinds if not k.startswith("triton-")]
    assert len(fallback) == len(dropped["layers"]) and "triton-mixed" in kinds
    # The fallback is what the format gets here without a plan (CPU float32: packed-f32 where it builds).
    plain, _, _ = load_model(str(art), torch.float32)
    assert set(fallback) == {type(m).kernel for m in plain.modules() if hasattr(type(m), "kernel")}


def test_formats_without_a_kernel_are_named():
    from quantpipe.formats.artifact import QuantWeight
    from quantpipe.kernels.plan import weight_case

    q = torch.zeros(64, 512, dtype=torch.int8)
    key, kernel, reason = weight_case(QuantWeight(q, torch.ones(64, 2), None, 4, 256))
    assert key == "mixed_gemm/W4A16/g256/sym/64x512" and "group size 256" in reason
    _, kernel, reason = weight_case(QuantWeight(q, torch.ones(64, 8), torch.zeros(64, 8), 8, 64, act_bits=8))
    assert kernel == "w8a8_gemm" and "per-channel symmetric" in reason
    assert weight_case(QuantWeight(q, torch.ones(64, 1), None, 8, None, act_bits=8))[2] is None
