"""The identity of a model on disk: one sha256 for a GGUF file or a model folder.

An artifact folder's hash covers the files that define the model (weights, config,
tokenizer), not quantpipe.json (the manifest, which records timings) nor kernels.json
(the kernel choices, rebuilt per device): the eval report, the gate verdict and the
registry all name a candidate by this hash, so a changed weight file is a new model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from quantpipe.manifest import sha256_bytes, sha256_file

NOT_MODEL_FILES = ("quantpipe.json", "kernels.json")


def artifact_sha256(path: str | os.PathLike) -> str:
    path = Path(path)
    parts = [f"{f.name}:{sha256_file(f)}" for f in sorted(path.iterdir())
             if f.is_file() and f.name not in NOT_MODEL_FILES]
    return sha256_bytes("\n".join(parts).encode())


def model_sha256(path: str | os.PathLike) -> str:
    """A GGUF file's own hash, or a model folder's artifact hash."""
    return sha256_file(path) if os.path.isfile(path) else artifact_sha256(path)


def read_manifest(path: str | os.PathLike, what: str = "artifact") -> dict:
    """An artifact's quantpipe.json; a clear error naming `what` when it is not one."""
    from quantpipe.manifest import StageError

    f = Path(path) / "quantpipe.json"
    if not f.is_file():
        raise StageError(f"{what} {path}: not a quantpipe artifact (no quantpipe.json); make one with "
                         f"`quantpipe quantize`")
    try:
        manifest = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StageError(f"{what} {path}: quantpipe.json is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("stage") != "quantize":
        raise StageError(f"{what} {path}: quantpipe.json is not a quantize manifest (needs stage 'quantize')")
    src = manifest.get("source_model")
    if not isinstance(src, dict) or not isinstance(src.get("sha256"), str):
        raise StageError(f"{what} {path}: quantpipe.json has no source_model.sha256 (the model it was quantized from)")
    return manifest
