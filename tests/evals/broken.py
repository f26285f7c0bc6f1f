"""The deliberately broken candidates that the default gate must fail (and the W8A16 and
static-KV ones it must pass), built from a W8A16 artifact of the default model. Shared by
tests/evals/test_eval_gate.py and the gate's calibration (benchmarks/bench_flips.py)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantpipe.formats.packing import pack_int32, unpack_int32
from quantpipe.quantize import QuantConfig, quantize

DAMAGED = "metadata.task=code_complete"  # the stratum the one-stratum artifact damages
PROJ = "model.layers.{}.mlp.down_proj"


def variant(src: Path, dst: Path, edit) -> str:
    """A copy of the artifact at `src` whose tensors `edit` changes in place."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def two_bit(state):
    """Every quantized weight cut to 4 levels (2 bits) inside its INT8 container."""
    for k in [k for k in state if k.endswith(".weight_packed")]:
        rows, cols = state[k.replace("_packed", "_shape")].tolist()
        q = unpack_int32(state[k], 8, cols)
        state[k] = pack_int32((torch.round(q.float() / 64).clamp(-2, 1) * 64).to(torch.int8), 8)


def scales_off(state):
    """Scales 30% too large in three layers: the rounding was right, the scale is not."""
    for i in (3, 14, 25):
        state[PROJ.format(i) + ".weight_scale"] = state[PROJ.format(i) + ".weight_scale"] * 1.3


def kv_scales_off(state):
    """Every static KV scale 4x too large: the cache keeps about 5 of its 8 bits."""
    for k in [k for k in state if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))]:
        state[k] = state[k] * 4


def code_tokens(heldout: str, tokenizer) -> list[int]:
    """Tokens frequent in the damaged stratum's held-out texts and absent from every other one."""
    inside, outside = Counter(), set()
    for line in Path(heldout, "heldout.jsonl").read_text().splitlines():
        row = json.loads(line)
        ids = tokenizer.encode(row["text"])
        if f"metadata.task={row['strata']['metadata.task']}" == DAMAGED:
            inside.update(ids)
        else:
            outside.update(ids)
    return [t for t, n in inside.most_common() if t not in outside and n >= 2]


def build(tmp: Path, sample_set: str, w8a16_artifact: str) -> dict[str, str]:
    """The six candidates, by name, as folders under `tmp`: w8a16, w2 (2-bit weights),
    scales-off (three layers' scales 30% too large), code-damaged (one stratum's tokens
    perturbed), kv-int8 (static INT8 KV, calibrated) and kv-scales-off (its scales 4x)."""
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    w8 = tmp / "w8a16"
    shutil.copytree(w8a16_artifact, w8)
    tokens = torch.tensor(code_tokens(sample_set, load_tokenizer(None)))
    assert len(tokens) >= 20, "the damaged stratum needs tokens of its own"

    def one_stratum(state):
        # Input embeddings of those tokens get noise; lm_head keeps the original rows
        # (untied), so only texts that contain the tokens are affected. 0.25 of each row's
        # norm: a KL near 0.03 on that stratum, under 0.01 overall (measured).
        emb = state["model.embed_tokens.weight"].float()
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        gen = torch.Generator().manual_seed(0)
        noise = torch.randn(len(tokens), emb.shape[1], generator=gen) / emb.shape[1] ** 0.5
        emb[tokens] += 0.25 * noise * emb[tokens].norm(dim=1, keepdim=True)
        state["model.embed_tokens.weight"] = emb.to(torch.bfloat16)

    def untie(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        return str(folder)

    kv = tmp / "kv-int8"  # W8A16 with a static INT8 KV cache, its scales calibrated on the sample set
    quantize(None, QuantConfig(scheme="W8A16", kv_cache="int8", kv_cache_strategy="channel", calib_samples=32),
             sample_set, str(kv))
    candidates = [str(w8), variant(w8, tmp / "w2", two_bit), variant(w8, tmp / "scales-off", scales_off),
                  untie(Path(variant(w8, tmp / "code-damaged", one_stratum))), str(kv),
                  variant(kv, tmp / "kv-scales-off", kv_scales_off)]
    return {Path(c).name: c for c in candidates}




if __name__ == "__main__":
    # python -m tests.evals.broken OUT CALIB_SET W8A16_ARTIFACT: build the six into OUT and
    # print {name: folder} as JSON (tests/evals/test_eval_gate.py builds them in a subprocess).
    import sys

    out, calib_set, w8a16 = sys.argv[1:4]
    print(json.dumps(build(Path(out), calib_set, w8a16)))
