"""The fast GGUF reader reads what gguf's own GGUFReader reads, dequantizes to the bit what
gguf's own code computes, and refuses damaged files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from quantpipe.runtime.model.gguf_file import dequantize, read_gguf
from quantpipe.runtime.model.loader import resolve_model_path


@pytest.fixture(scope="module")
def path():
    return resolve_model_path(None)


def test_metadata_and_tensors_equal_ggufreaders(path):
    ours, ref = read_gguf(path), GGUFReader(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # GGUFReader's header
    assert ours.metadata == fields
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_dequantize_is_ggufs_arithmetic_to_the_bit(path):
    tensors = read_gguf(path).tensors
    # Every weight type of the default model: its torch paths (Q4_1, Q8_0) and the plain one.
    assert {t.tensor_type.name for t in tensors} == {"Q4_1", "Q8_0", "F32"}
    for t in tensors:
        ours, ref = dequantize(t), torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert ours.dtype == torch.float32 and ours.shape == ref.shape, t.name
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), t.name


def test_damaged_files_are_refused_with_the_reason(path, tmp_path):
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200_000])  # inside the vocabulary
    with pytest.raises(ValueError, match="truncated GGUF file"):
        read_gguf(str(cut))
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:len(data) - 1000])  # the last tensor's data is cut
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_gguf(str(short))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"NOPE" + data[4:4096])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(other))
