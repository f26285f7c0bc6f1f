"""A model larger than the memory limit quantizes under it (`--max-memory`): each quantize
process's data segment (`RLIMIT_DATA`: its heap, anonymous mappings and thread stacks) is
capped at 1.5 GB by the test's own script before torch is imported. The whole-model path
under the same cap runs out of memory: the cap binds (it stops at its first large request,
the private mapping safetensors makes of the embedding's 1.07 GB shard, which the cap counts;
the float32 model it would go on to build is 5.0 GB).

RTN and GPTQ quantize one random Llama of 2.5 GB in bf16 (5.0 GB in float32): Gemma 3's
262,144-token vocabulary at hidden size 2048 (untied embeddings and lm_head, 2.15 GB; the
lm_head alone is 2.15 GB in float32, over the cap) and 8 decoder layers of 46 MB. GPTQ's time
grows with the decoder layers (each calibrates on twice its input size in tokens and walks
its input columns one by one), so the test's model has few and wide ones; the same 2.5 GB as
130 layers of hidden size 1024 is in BENCHMARKS.md ("Models larger than memory",
benchmarks/bench_stream_memory.py). The runs are subprocesses, so they go beside the rest of
the suite on idle CPU time (tests/idle_jobs.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1_500_000_000
METHODS = ("rtn", "gptq")
LAYERS, HIDDEN = 8, 2048
VOCAB, HEADS, KV_HEADS = 262_144, 16, 4


def write_big_llama(folder: Path, layers: int, hidden: int) -> int:
    """A random Llama-architecture HF folder (MLP as wide as `hidden`) in bf16 shards of about
    256 MB, written a tensor at a time (the writer never holds the model); returns its bytes of
    weights."""
    from safetensors.torch import save_file

    big = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS)
    cfg = {**big, "num_hidden_layers": layers, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    h = inter = hidden
    kv = h // HEADS * KV_HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "lm_head.weight": (VOCAB, h),
              "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, shape in shapes.items():
        shard[name] = t = (torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else
                           torch.randn(shape, generator=g, dtype=torch.bfloat16).mul_(shape[-1] ** -0.5))
        total += 2 * t.numel()
        if sum(2 * x.numel() for x in shard.values()) > 256 * 1000 ** 2:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


# The quantize process: caps its own data segment first (before torch), then quantizes with
# sequences of 512 calibration tokens, as many as GPTQ's floor (2 x the input size) takes,
# and prints the manifest's memory record.
QUANTIZE_UNDER_LIMIT = """
import json, resource, sys
src, out, method, budget, cap = sys.argv[1:6]
if cap != "none":
    resource.setrlimit(resource.RLIMIT_DATA, (int(cap), int(cap)))
from quantpipe.quantize import QuantConfig, quantize
hidden = json.load(open(src + "/config.json"))["hidden_size"]
seqs = 2 * hidden // 512
calib = [[(7 * s + 13 * k) % 262144 for k in range(512)] for s in range(seqs)]
cfg = QuantConfig(scheme="W4A16", group_size=128, method=method, calib_samples=seqs, calib_seq_len=512)
art = quantize(src, cfg, None, out, calib_token_ids=calib, **({} if budget == "whole" else {"max_memory": int(budget)}))
print(json.dumps({k: art.manifest[k] for k in ("memory", "peak_rss_mib", "method", "calibration")}))
"""


def quantize_argv(src: Path, out: Path, method: str, budget: int | None, cap: int | None) -> list[str]:
    return [sys.executable, "-c", QUANTIZE_UNDER_LIMIT, str(src), str(out), method,
            "whole" if budget is None else str(budget), "none" if cap is None else str(cap)]


def _big_model_runs(runner, folder: Path) -> dict:
    import shutil

    src = folder / "llama"
    done = {"write": runner.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from tests.quantize.test_stream_memory import write_big_llama; "
         "print(write_big_llama(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))", str(src), str(LAYERS),
         str(HIDDEN)], cwd=ROOT, env=_env(), cpu_seconds=600)}
    if done["write"].returncode != 0:
        return done
    done["whole"] = runner.run(quantize_argv(src, folder / "whole", "rtn", None, LIMIT), cwd=ROOT, env=_env(),
                               cpu_seconds=600)
    done["whole_written"] = (folder / "whole").exists()
    for method in METHODS:
        out = folder / method
        done[method] = runner.run(quantize_argv(src, out, method, LIMIT, LIMIT), cwd=ROOT, env=_env(), cpu_seconds=1500)
        if out.exists():
            done[method + "_config"] = json.loads((out / "config.json").read_text())
            done[method + "_files"] = sorted(f.name for f in out.iterdir())
        shutil.rmtree(out, ignore_errors=True)  # 1.4 GB of disk
    shutil.rmtree(src, ignore_errors=True)  # 2.5 GB
    return done


def _env() -> dict:
    import os

    return dict(os.environ, TOKENIZERS_PARALLELISM="false")


IDLE_JOB = _big_model_runs


@pytest.fixture(scope="module")
def runs(idle_jobs) -> dict:
    return idle_jobs.result(__name__)


def test_the_model_is_larger_than_the_limit_and_the_whole_path_runs_out(runs):
    assert runs["write"].returncode == 0, runs["write"].stderr[-3000:]
    size = int(runs["write"].stdout.strip())
    assert size > 2.5e9 and 2 * size > 3 * LIMIT  # float32 whole: over three times the cap
    assert runs["whole"].returncode != 0 and not runs["whole_written"]
    assert "MemoryError" in runs["whole"].stderr or "allocate" in runs["whole"].stderr, runs["whole"].stderr[-2000:]


@pytest.mark.parametrize("method", METHODS)
def test_it_quantizes_under_the_limit(runs, method):
    got = runs[method]
    assert got.returncode == 0, got.stderr[-3000:]
    record = json.loads(got.stdout.strip().splitlines()[-1])
    memory = record["memory"]
    assert memory["streamed"] and record["peak_rss_mib"] * 1024 ** 2 <= LIMIT, record
    assert memory["plan"]["estimate_mib"] * 1024 ** 2 <= LIMIT
    assert record["method"] == method
    weights = runs[method + "_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["num_bits"] == 4 and weights["group_size"] == 128
    shards = [f for f in runs[method + "_files"] if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in runs[method + "_files"]
