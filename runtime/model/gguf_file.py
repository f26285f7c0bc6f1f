"""A GGUF file's metadata and tensors, read in a fraction of a second.

`gguf.GGUFReader` builds a numpy view for every element of every array field, so the
default model's 49k-token vocabulary and merges took 4-9 s to open, paid by every server,
stage and test that loads a model or a tokenizer. This reader decodes string arrays in
one pass over the bytes and maps the tensor data without copying; the data arrays have
the shapes and dtypes `gguf.quants.dequantize` expects (GGUFReader's). `dequantize` turns a
tensor into float32 torch weights: Q4_1 and Q8_0 (every weight of the default model) with
torch's kernels, to the bit what gguf's numpy code computes in about 0.6x its time; other
types through gguf's code.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
import torch

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class Tensor:
    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF stores it: innermost dimension first
    data: np.ndarray  # a view of the file


@dataclass
class GGUFFile:
    path: str
    metadata: dict  # key -> int, float, bool, str, or a list of them
    tensors: list[Tensor]
    mapping: mmap.mmap | None = None  # the file, mapped read-only; the tensors' data are views of it

    def release_pages(self) -> None:
        """Drop the file's pages from this process's memory (they are read again on the next
        access): a reader that goes through a large file once keeps only what it copied out."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: truncated GGUF file (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF file (a string runs past the end at byte {self.pos})")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError(f"{self.path}: truncated GGUF file (an array runs past the end)")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]  # arrays of arrays: rare, and small
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")


def read_gguf(path: str) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    _PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
              GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
              GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
              GGMLQuantizationType.I64: np.int64}
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm = np.frombuffer(mapping, dtype=np.uint8)
    cur = _Cursor(memoryview(mm), path)
    if bytes(mm[:4]) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        # Also what a big-endian file looks like from here: its version reads byte-swapped.
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = cur.pos + (-cur.pos) % align
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(reversed(dims))  # numpy order: outermost first
        count = int(np.prod(dims, dtype=np.int64))
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {kind}") from None
        if qtype in _PLAIN:
            dtype = _PLAIN[qtype]
            nbytes = count * np.dtype(dtype).itemsize
        else:  # quantized (and bf16): rows of blocks, as bytes
            block, size = GGML_QUANT_SIZES[qtype]
            dtype, nbytes = np.uint8, count * size // block
            shape = (*shape[:-1], shape[-1] // block * size)
        begin = start + offset
        if begin + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        data = mm[begin:begin + nbytes].view(dtype).reshape(shape)
        tensors.append(Tensor(name, qtype, dims, data))
    return GGUFFile(path, metadata, tensors, mapping)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 weights in 20 bytes: float16 scale d, float16 minimum m, 16 bytes whose
    low nibbles are weights 0-15 and high nibbles 16-31; each weight is d * q + m."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    qs = blocks[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
    return q.mul_(d).add_(m)  # two roundings, as numpy's (d * qs) + m: no fused multiply-add


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 weights in 34 bytes: float16 scale d, then 32 int8 values; each weight is q * d."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)


def dequantize(t: Tensor) -> torch.Tensor:
    """The tensor as float32 weights (numpy order of dimensions, outermost first)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    fast = {GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q8_0: _q8_0}.get(t.tensor_type)
    if fast is None:
        from gguf.quants import dequantize as gguf_dequantize

        return torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
    block, size = GGML_QUANT_SIZES[t.tensor_type]
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(-1, size))  # a copy: the file's view is read-only
    shape = (*t.data.shape[:-1], t.data.shape[-1] // size * block)
    return fast(raw).reshape(shape)
