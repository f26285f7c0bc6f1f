"""What every stage output shares: input hashes, the code version, and all-or-nothing writes.

A stage writes into a temporary folder beside its `--out` and renames it into place only
once every file is complete, so a stage that fails (or is killed) leaves no partial
output under the name the next stage reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import quantpipe

MANIFEST_VERSION = 1


class StageError(Exception):
    """A stage refused its input; the message names the parameter or file and the limit."""


def read_yaml(path: str | os.PathLike, option: str):
    """A YAML file's content; a missing or malformed file is a StageError naming `option`."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise StageError(f"{option} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise StageError(f"{option} {path}: not valid YAML: {e}") from None


def file_digest(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read now."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_digests: dict[tuple, str] = {}
RACY_S = 2.0  # a file changed this recently may change again within one timestamp tick: not remembered


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 of a file, read once per process while the file stays the same: its device,
    inode, size, mtime and ctime (any write or rename of the file itself changes the
    ctime), so a pipeline's stages name the same artifact, calibration set and model
    without reading them again. As git does with its index, a file modified in the last
    RACY_S seconds is read afresh each time: a write within one timestamp tick of the read
    could leave its times unchanged (2 s covers the coarsest file systems' clocks)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _digests:
        return _digests[key]
    digest = file_digest(path)
    if time.time() - max(st.st_mtime, st.st_ctime) > RACY_S:
        _digests[key] = digest
    return digest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_version() -> str:
    """quantpipe's version, plus the git commit (and '-dirty') when run from a checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return quantpipe.__version__
    return f"{quantpipe.__version__}+g{sha}{'-dirty' if dirty else ''}"


def write_json(path: str | os.PathLike, obj) -> None:
    """Deterministic JSON (sorted keys, fixed separators): same object, same bytes."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder that becomes `out` only if the block finishes without error."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise StageError(f"--out {out} already exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the output is an ordinary folder
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
