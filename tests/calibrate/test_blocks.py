"""Worker processes read logs as blocks of bytes: the lines they split are `open_lines`' lines."""

from __future__ import annotations

import gzip

import pytest

from quantpipe.calibrate.sources import block_lines, open_blocks, open_lines

CONTENT = ('{"a": "caf\u00e9 \u2014 \u4e2d\u6587"}\n\n{"b": 1}\r\n'.encode() + b'{"bad": "\xff\xfe"}\n'
           + b'x' * 5000 + b'\n' + '{"last": "\u00e9"}'.encode())  # no newline at the end: a torn tail


@pytest.mark.parametrize("size", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_blocks_split_into_the_same_lines(tmp_path, size, suffix):
    path = tmp_path / f"log.jsonl{suffix}"
    path.write_bytes(gzip.compress(CONTENT) if suffix else CONTENT)
    want = list(open_lines(str(path)))
    got = [item for first, block in open_blocks(str(path), size) for item in block_lines(first, block)]
    assert got == want
    assert want[-1][2] is False and want[0][2] is True and len(want) == 6
