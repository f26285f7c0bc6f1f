"""`quantpipe kernels build`: the kernels an artifact needs, verified against their references and tuned.

1. Cases: each distinct (kernel, scheme, N, K) among the artifact's quantized matmuls, as
   the runtime runs them (q/k/v and gate/up fused), plus its KV cache's decode attention.
2. Verification: every config is run on random and real activations (the artifact's own
   inputs to that layer on real text) and compared with the torch reference; an error past
   the bound for the dtype fails the stage, naming the case, config and input.
3. Tuning (CUDA): per batch bucket, the fastest verified config by Triton's benchmarker,
   timed beside the bf16 matmul of the same shape.
4. kernels.json (and Triton's cache, so a restart does not recompile) are written into the
   artifact only when every case passed; a failure leaves the artifact as it was.

With `interpret=True` the same verification runs in Triton's CPU interpreter on reduced
shapes (the first rows and groups of each real weight) and nothing is written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from quantpipe.formats import artifact as artifact_format
from quantpipe.formats.artifact import QuantWeight
from quantpipe.formats.packing import container_bits, pack_int32
from quantpipe.kernels import int8_gemm, mixed_gemm, paged_attention, reference
from quantpipe.kernels.configs import INTERPRET_CONFIGS, GemmConfig, gemm_configs
from quantpipe.kernels.plan import CACHE_DIR, PLAN_FILE, PLAN_FORMAT, triton_version, weight_case
from quantpipe.manifest import StageError, code_version, sha256_file, write_json
from quantpipe.runtime.model.config import ModelConfig
from quantpipe.runtime.model.kv_cache import make_kv_cache

# Bound on max |kernel - reference| / max |reference| per activation dtype: a few roundings
# of the dtype (fp32 accumulation order; the bf16/fp16 output and the weights cast for tl.dot).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.4e-2}
INTERPRET_ROWS = (1, 5, 19)  # one row, a partial tile, more than one tile of 16
ATTENTION_BLOCK_SIZE = 16  # the engine's default block size


class VerificationError(StageError):
    """A kernel disagreed with its reference past the stated bound."""


@dataclass
class Case:
    key: str
    kernel: str
    weight: QuantWeight  # the first layer's: verified, and its shape is every layer's
    layers: list[str] = field(default_factory=list)
    reason: str | None = None  # why there is no kernel for it


@dataclass
class Artifact:
    path: Path
    config: ModelConfig
    cases: list[Case]
    kv_cache_dtype: str
    kv_scales: list | None
    files: list[str]


def read_artifact(path: str | Path) -> Artifact:
    """The artifact's matmul cases; a malformed one is refused naming the tensor."""
    from quantpipe.runtime.model.loader import quantized_layers

    path = Path(path)
    try:
        raw, state = artifact_format.load_checkpoint(path)
    except ValueError as e:
        raise StageError(f"ARTIFACT {path}: {e}") from None
    qcfg = raw.get("quantization_config")
    if not qcfg:
        raise StageError(f"ARTIFACT {path}: config.json has no quantization_config (not a quantized artifact)")
    files = sorted(str(f) for f in path.glob("*.safetensors"))
    cfg = ModelConfig.from_hf(raw)
    try:
        quant = quantized_layers(state, qcfg, cfg)
        kv_dtype, kv_scales = artifact_format.kv_cache_format(qcfg, state, cfg.num_layers, cfg.num_kv_heads,
                                                              cfg.head_dim)
    except ValueError as e:
        raise StageError(f"ARTIFACT {path}: {e}") from None
    cases: dict[str, Case] = {}
    for name, qw in quant.items():
        key, kernel, reason = weight_case(qw)
        cases.setdefault(key, Case(key, kernel, qw, reason=reason)).layers.append(name)
    return Artifact(path, cfg, list(cases.values()), kv_dtype, kv_scales, files)


def real_activations(art: Artifact, names: list[str], rows: int) -> dict[str, torch.Tensor]:
    """Each named layer's float32 inputs [rows, K] when the artifact's model reads real text."""
    from quantpipe.runtime.model.forward import sequence_logits
    from quantpipe.runtime.model.loader import load_model
    from quantpipe.runtime.workload.text import corpus_text

    model, cfg, tokenizer = load_model(str(art.path), torch.float32, torch.device("cpu"), quant_kernel="dequant")
    if tokenizer is not None:
        ids = tokenizer.encode(corpus_text()[:20000])[:rows]
    else:  # no tokenizer in the artifact: still the model's own activations, on arbitrary tokens
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(0)).tolist()
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: seen.setdefault(n, args[0].reshape(-1, args[0].shape[-1]).detach().clone()))
        for n in names]
    try:
        sequence_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return {n: x.repeat(-(-rows // x.shape[0]), 1)[:rows] for n, x in seen.items()}


def reduced(qw: QuantWeight) -> QuantWeight:
    """The first rows and groups of a weight: interpreter-sized, tails included (72 rows, 3 groups)."""
    n, k = qw.q.shape
    gs = qw.group_size
    n2, k2 = min(n, 72), min(k, 3 * gs if gs else 160)
    g2 = k2 // gs if gs else 1
    return QuantWeight(qw.q[:n2, :k2].contiguous(), qw.scale[:n2, :g2].contiguous(),
                       None if qw.zero is None else qw.zero[:n2, :g2].contiguous(), qw.num_bits, gs, qw.act_bits)


class GemmCase:
    """One case's kernel and reference on one device: weights prepared once."""

    def __init__(self, case: Case, qw: QuantWeight, device: torch.device):
        self.case, self.qw = case, qw
        self.scale = qw.scale.float().to(device)
        self.bits = container_bits(qw.num_bits)  # the layout the kernel reads
        if case.kernel == "mixed_gemm":
            self.packed = pack_int32(qw.q, self.bits).to(device)
            self.zero = None if qw.zero is None else qw.zero.float().to(device)
        else:
            self.weight = qw.q.to(device)

    def run(self, x: torch.Tensor, config: GemmConfig) -> torch.Tensor:
        if self.case.kernel == "mixed_gemm":
            return mixed_gemm.mixed_gemm(x, self.packed, self.scale, self.zero, self.bits, self.qw.group_size,
                                         config)
        return int8_gemm.w8a8_gemm(x, self.weight, self.scale, config)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.case.kernel == "mixed_gemm":
            return reference.mixed_gemm_ref(x, self.packed, self.scale, self.zero, self.bits, self.qw.group_size)
        return reference.w8a8_gemm_ref(x, self.weight, self.scale)

    def check(self, x: torch.Tensor, config: GemmConfig, label: str) -> dict:
        y = self.run(x, config).float()
        ref = self.reference(x)
        err = (y - ref).abs().max().item()
        rel = err / max(ref.abs().max().item(), 1e-30)
        bound = TOLERANCE[x.dtype]
        if not rel <= bound:  # also catches NaN
            raise VerificationError(
                f"kernel verification failed for case {self.case.key} (layers {', '.join(self.case.layers[:3])}"
                f"{', ...' if len(self.case.layers) > 3 else ''}), config {config}, {label} activations "
                f"[{x.shape[0]}, {x.shape[1]}] {str(x.dtype).removeprefix('torch.')}: max abs error {err:.3g}, "
                f"relative {rel:.3g} > bound {bound:g}")
        return {"max_abs_err": err, "max_rel_err": rel}


def verify_attention(art: Artifact, device: torch.device, dtype: torch.dtype) -> dict:
    """Decode attention over the artifact's KV format on a block table with a shared prefix,
    against the reference; for an INT8 cache also the write kernel against the cache's own write."""
    cfg = art.config
    kind = art.kv_cache_dtype
    bs = ATTENTION_BLOCK_SIZE
    static = art.kv_scales[0] if art.kv_scales else None
    gen = torch.Generator().manual_seed(0)
    num_blocks = 12
    cache = make_kv_cache(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, dtype, device, kind, static)
    tables = torch.tensor([[1, 2, 3], [1, 2, 5], [7, 0, 0]], device=device)  # the first two share two blocks
    lens = torch.tensor([37, 40, 5], device=device)
    slots = sorted({int(t) * bs + o for row, n in zip(tables.tolist(), lens.tolist()) for p in range(n)
                    for t, o in [(row[p // bs], p % bs)]})
    slots_t = torch.tensor(slots, device=device)
    shape = (len(slots), cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, generator=gen).to(device, dtype)
    v = torch.randn(shape, generator=gen).to(device, dtype)
    cache.write(slots_t, k, v)
    result = {"key": f"paged_decode/{kind}{'-static' if static is not None else ''}/"
                     f"H{cfg.num_heads}xKVH{cfg.num_kv_heads}xD{cfg.head_dim}/block{bs}"}
    if kind == "int8":
        mirror = make_kv_cache(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, dtype, device, kind, static)
        paged_attention.kv_write(mirror, slots_t, k, v)
        for i in range(2):
            step = (mirror.q[i][slots_t].int() - cache.q[i][slots_t].int()).abs()
            if step.max() > 1 or (step > 0).float().mean() > 1e-3:
                raise VerificationError(f"kernel verification failed for the INT8 KV write ({result['key']}): "
                                        f"{int((step > 0).sum())} values differ from the runtime's write, "
                                        f"by up to {int(step.max())} steps (bound: 1 step in 0.1% of values)")
            if cache.static is None and not torch.equal(mirror.scale[i][slots_t], cache.scale[i][slots_t]):
                raise VerificationError(f"kernel verification failed for the INT8 KV write ({result['key']}): "
                                        f"its fp16 scales differ from the runtime's write")
    q = torch.randn((3, cfg.num_heads, cfg.head_dim), generator=gen).to(device, dtype)
    out = paged_attention.paged_decode(q, cache, tables, lens, bs).float()
    kd, vd = cache.gather(tables, bs)
    ref = reference.paged_decode_ref(q, kd, vd, lens)
    err = (out - ref).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-30)
    if not rel <= TOLERANCE[dtype]:
        raise VerificationError(f"kernel verification failed for {result['key']}: max abs error {err:.3g}, "
                                f"relative {rel:.3g} > bound {TOLERANCE[dtype]:g}")
    return {**result, "max_abs_err": err, "max_rel_err": rel}


def _inputs(real: torch.Tensor, rows: int, k: int, dtype: torch.dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    yield "random", torch.randn((rows, k), generator=gen).to(device, dtype)
    yield "real", real[:rows, :k].to(device, dtype)


def verify_interpreted(art: Artifact, echo=print) -> dict:
    """Every case in the interpreter on reduced shapes, every interpreter config, fp32 and bf16."""
    cases = [c for c in art.cases if c.reason is None]
    real = real_activations(art, [c.layers[0] for c in cases], max(INTERPRET_ROWS))
    cpu = torch.device("cpu")
    report = {"cases": [], "unsupported": [_unsupported(c) for c in art.cases if c.reason]}
    for case in cases:
        gc = GemmCase(case, reduced(case.weight), cpu)
        n, k = gc.qw.q.shape
        worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
        configs = [c for c in INTERPRET_CONFIGS if case.kernel == "mixed_gemm" or c.split_k == 1]
        for rows in INTERPRET_ROWS:
            for dtype in worst:
                for label, x in _inputs(real[case.layers[0]], rows, k, dtype, cpu, rows):
                    for config in configs:
                        worst[dtype] = max(worst[dtype], gc.check(x, config, label)["max_rel_err"])
        row = {"key": case.key, "layers": case.layers, "shape": [n, k], "configs": [str(c) for c in configs],
               "rows": list(INTERPRET_ROWS), "max_rel_err": {str(d).removeprefix("torch."): e for d, e in worst.items()}}
        report["cases"].append(row)
        echo(f"ok  {case.key} (verified on [{n}, {k}], {len(configs)} configs x {len(INTERPRET_ROWS)} batch sizes "
             f"x random/real x fp32/bf16): max relative error fp32 {worst[torch.float32]:.2g}, "
             f"bf16 {worst[torch.bfloat16]:.2g}")
    if art.kv_cache_dtype in ("auto", "int8"):
        att = verify_attention(art, cpu, torch.float32)
        report["attention"] = [att]
        echo(f"ok  {att['key']}: max relative error {att['max_rel_err']:.2g}")
    return report


def _unsupported(case: Case) -> dict:
    return {"key": case.key, "layers": case.layers, "reason": case.reason}


def _bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def tune(art: Artifact, buckets: list[int], device: torch.device, echo=print) -> dict:
    """Verify and autotune every case per bucket on CUDA; returns kernels.json's content."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    dtype = torch.bfloat16
    cases = [c for c in art.cases if c.reason is None]
    real = real_activations(art, [c.layers[0] for c in cases], max(buckets))
    out_cases = []
    for case in cases:
        gc = GemmCase(case, case.weight, device)
        n, k = case.weight.q.shape
        w_bf16 = case.weight.dequantize(dtype).to(device)
        per_bucket = {}
        for bucket in buckets:
            inputs = dict(_inputs(real[case.layers[0]], bucket, k, dtype, device, bucket))
            timed = []
            for config in gemm_configs(bucket, split_k=case.kernel == "mixed_gemm"):
                try:
                    errs = [gc.check(x, config, label) for label, x in inputs.items()]
                except (CompilationError, OutOfResources):
                    continue  # this tile does not fit the device: not a candidate
                timed.append((_bench_ms(lambda c=config: gc.run(inputs["real"], c)), config, errs))
            if not timed:
                raise StageError(f"case {case.key}: no config of the declared space compiled for batch {bucket}")
            ms, config, errs = min(timed, key=lambda t: t[0])
            base = _bench_ms(lambda: F.linear(inputs["real"], w_bf16))
            per_bucket[str(bucket)] = {
                "config": config.as_dict(), "time_us": ms * 1e3, "bf16_time_us": base * 1e3,
                "speedup_vs_bf16": base / ms, "configs_verified": len(timed),
                "max_rel_err": max(e["max_rel_err"] for e in errs), "max_abs_err": max(e["max_abs_err"] for e in errs)}
            echo(f"{case.key} batch {bucket}: {config} {ms * 1e3:.1f} us (bf16 {base * 1e3:.1f} us, "
                 f"{base / ms:.2f}x), {len(timed)} configs verified")
        out_cases.append({"key": case.key, "kernel": case.kernel, "layers": case.layers, "shape": [n, k],
                          "buckets": per_bucket})
    attention = [verify_attention(art, device, dtype)] if art.kv_cache_dtype in ("auto", "int8") else []
    props = torch.cuda.get_device_properties(device)
    return plan_document(art, props.name, (props.major, props.minor), buckets, out_cases, attention)


def plan_document(art: Artifact, device_name: str, capability: tuple[int, int], buckets: list[int],
                  cases: list[dict], attention: list[dict]) -> dict:
    """kernels.json's content: the tuned cases and what they were tuned on (read by plan.load_plan)."""
    return {"format": PLAN_FORMAT, "code_version": code_version(), "artifact": art.path.name,
            "weights_sha256": {Path(f).name: sha256_file(f) for f in art.files},
            "device": {"name": device_name, "capability": list(capability)},
            "triton": triton_version(), "torch": torch.__version__, "buckets": buckets,
            "tolerance": {str(d).removeprefix("torch."): t for d, t in TOLERANCE.items()},
            "cases": cases, "unsupported": [_unsupported(c) for c in art.cases if c.reason],
            "attention": attention}


def build(artifact: str | Path, device: str = "cuda", buckets: list[int] | None = None, interpret: bool = False,
          echo=print) -> dict:
    """The stage. interpret: verification only, in the interpreter, writing nothing."""
    art = read_artifact(artifact)
    for case in art.cases:
        if case.reason:
            echo(f"no kernel for {case.key} ({len(case.layers)} layers): {case.reason}; the runtime uses the "
                 f"torch fallback for it")
    if interpret:
        return verify_interpreted(art, echo)
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise StageError(f"kernels build needs a CUDA device to tune (--device {device}; torch sees "
                         f"{torch.cuda.device_count()} CUDA devices); {art.path} is unchanged. --interpret verifies "
                         f"its kernels in Triton's interpreter on reduced shapes instead")
    buckets = list(buckets or ())
    tmp_cache = Path(tempfile.mkdtemp(prefix=f".{CACHE_DIR}.partial-", dir=art.path))
    old_cache_env = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_cache)
    try:
        plan = tune(art, buckets, torch.device(device), echo)
        tmp_plan = art.path / f".{PLAN_FILE}.partial"
        write_json(tmp_plan, plan)
        final_cache = art.path / CACHE_DIR
        if final_cache.exists():
            shutil.rmtree(final_cache)
        os.replace(tmp_cache, final_cache)
        os.replace(tmp_plan, art.path / PLAN_FILE)
        return plan
    except BaseException:
        shutil.rmtree(tmp_cache, ignore_errors=True)
        (art.path / f".{PLAN_FILE}.partial").unlink(missing_ok=True)
        raise
    finally:
        if old_cache_env is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old_cache_env
