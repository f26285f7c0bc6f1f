"""quantpipe.formats.artifact, the artifact's one owner: what it writes it reads back
exactly, and its hash is computed once per file yet never stale."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from quantpipe import manifest
from quantpipe.formats import artifact
from quantpipe.formats.artifact import QuantWeight


def _group(bits: int, symmetric: bool, group_size: int | None, fmt: str) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group_size else "channel", "group_size": group_size}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt}}}


@pytest.mark.parametrize("bits,symmetric,group_size,fmt", [
    (4, True, 64, "pack-quantized"), (4, False, 32, "pack-quantized"), (8, True, None, "pack-quantized"),
    (8, False, 64, "pack-quantized"), (8, True, None, "int-quantized")])
def test_written_tensors_read_back_exactly(bits, symmetric, group_size, fmt):
    gen = torch.Generator().manual_seed(bits + group_size if group_size else bits)
    n, k = 40, 128
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=gen).to(torch.int8)
    groups = k // group_size if group_size else 1
    scale = torch.rand(n, groups, generator=gen) + 0.01
    zero = torch.randint(lo, hi + 1, (n, groups), generator=gen).float() if not symmetric else None
    qw = QuantWeight(q, scale.to(torch.bfloat16).float(), zero, bits, group_size)
    state = artifact.quantized_tensors("model.layers.0.mlp.down_proj", qw, fmt, torch.bfloat16)
    state["model.norm.weight"] = torch.ones(4)
    qcfg = _group(bits, symmetric, group_size, fmt)
    artifact.validate(qcfg)
    back = artifact.read_quantized(state, qcfg, "model.layers.0.mlp.down_proj")
    assert torch.equal(back.q, q) and torch.equal(back.scale, qw.scale)
    assert (back.zero is None) == symmetric and (symmetric or torch.equal(back.zero, zero))
    assert (back.num_bits, back.group_size) == (bits, group_size)
    assert list(state) == ["model.norm.weight"]  # the module's tensors were consumed, nothing else


def test_kv_scales_read_back_under_their_names():
    scales = [(torch.rand(3, 8) + 0.1, torch.rand(3, 8) + 0.1) for _ in range(2)]
    state = artifact.kv_scale_tensors(scales)
    qcfg = {"kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "channel", "dynamic": False,
                                "symmetric": True}}
    kind, back = artifact.kv_cache_format(qcfg, state, num_layers=2, kv_heads=3, head_dim=8)
    assert kind == "int8" and not state
    assert all(torch.equal(a, b) for pair, got in zip(scales, back) for a, b in zip(pair, got))


def test_an_unknown_layer_format_is_refused():
    qw = QuantWeight(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), None, 8, None)
    with pytest.raises(ValueError, match="pack-quantized or int-quantized"):
        artifact.quantized_tensors("x", qw, "marlin-24", torch.bfloat16)


def test_hash_is_fresh_after_any_change_and_memoized_otherwise(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "quantpipe.json").write_text("{}")  # not part of the model's identity
    old = time.time() - 60
    for f in tmp_path.iterdir():
        os.utime(f, (old, old))
    # An hour on, every file is past the racy window and can be remembered.
    monkeypatch.setattr(manifest.time, "time", lambda real=time.time: real() + 3600)
    first = artifact.artifact_sha256(tmp_path)
    calls = []
    real = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda f: calls.append(f) or real(f))
    assert artifact.artifact_sha256(tmp_path) == first and not calls  # nothing re-read
    (tmp_path / "quantpipe.json").write_text('{"x": 1}')
    assert artifact.artifact_sha256(tmp_path) == first
    # Same size, same mtime put back: the inode's change time still tells (a clock tick on).
    time.sleep(0.05)
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    os.utime(tmp_path / "model.safetensors", (old, old))
    assert artifact.artifact_sha256(tmp_path) != first and calls
    # Renamed, the same files are the same files: nothing read again.
    calls.clear()
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    artifact.artifact_sha256(tmp_path)
    tmp_path.rename(moved)
    assert artifact.artifact_sha256(moved) != first and not calls


def test_a_recently_written_file_is_hashed_each_time(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    artifact.artifact_sha256(tmp_path)
    calls = []
    real = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda f: calls.append(f) or real(f))
    artifact.artifact_sha256(tmp_path)
    assert len(calls) == 1  # written under manifest.RACY_S ago: a write in the same timestamp tick could hide


def test_corrupt_checkpoint_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: missing \(not a model folder\)"):
        artifact.load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        artifact.load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        artifact.load_checkpoint(tmp_path)


def test_sharded_checkpoints_are_read_through_their_index(tmp_path):

    (tmp_path / "config.json").write_text("{}")
    a, b = {"x": torch.ones(2)}, {"y": torch.zeros(3)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    index = tmp_path / "model.safetensors.index.json"

    def write_index(weight_map):
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    write_index({"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"})
    save_file({"x": torch.full((2,), 7.0)}, tmp_path / "consolidated.safetensors")  # not in the index: not read
    _, state = artifact.load_checkpoint(tmp_path)
    assert set(state) == {"x", "y"} and state["x"].tolist() == [1.0, 1.0]
    write_index({"x": "model-00001-of-00002.safetensors", "y": "model-00003-of-00002.safetensors"})
    with pytest.raises(ValueError, match=r"index\.json: names shard model-00003-of-00002\.safetensors, which is not"):
        artifact.load_checkpoint(tmp_path)
    write_index({"x": "model-00002-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"})
    with pytest.raises(ValueError, match=r"index\.json: maps tensor 'x' to model-00002-of-00002\.safetensors, which"):
        artifact.load_checkpoint(tmp_path)
    write_index({"w": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"})
    with pytest.raises(ValueError, match=r"00001-of-00002\.safetensors: holds tensor 'x', which .* maps to no shard"):
        artifact.load_checkpoint(tmp_path)
    index.write_text('{"weight_map": {"x": "../elsewhere.safetensors"}}')
    with pytest.raises(ValueError, match=r"index\.json: weight_map must map tensor names to \.safetensors files"):
        artifact.load_checkpoint(tmp_path)
    index.unlink()  # without an index, a tensor in two files is ambiguous
    with pytest.raises(ValueError, match=r"tensor 'x' is also in another \*\.safetensors file"):
        artifact.load_checkpoint(tmp_path)
