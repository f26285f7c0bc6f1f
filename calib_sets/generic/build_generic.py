"""Rebuild calib_sets/generic/generic.jsonl.gz: the "generic corpus" baseline.

    .venv/bin/python calib_sets/generic/build_generic.py [--texts 2500] [--out PATH] [--seed 0]

Plain English prose about Python, one paragraph per line as {"text": ...}: what a
calibration set looks like when it is made without the production traffic, to compare
against sets sampled from calib_sets/sample/requests.jsonl.gz. Every paragraph comes
from text this Python ships (so no download): the prose of its documentation topics
(pydoc_data), then prose paragraphs of standard-library docstrings. Code blocks,
grammar rules, doctests, tables and lists are dropped; no prompts, no Q&A.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import re
import sys
from pydoc_data.topics import topics

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "ensurepip", "turtledemo"}
# Anything code-like: a doctest, grammar rule, bracket, operator, reST role, backquote or bullet.
CODE = re.compile(r">>>|::=|\.\.\. |^\s*[-*+] |\w\(.*\)\s*->|[{}\[\]<>|\\]|==|\+=|:\w+:|`|\w\.\w+\(|\w_\w+\(", re.M)


def paragraphs(text: str):
    """Blank-line separated blocks as single lines, skipping headings and nested (code) blocks."""
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines or re.search(r"^\s*[*=\-~^]{3,}\s*$", block, re.M):
            continue  # empty, or a heading with its underline
        if len({len(ln) - len(ln.lstrip()) for ln in lines}) > 2:
            continue  # several indentation levels: code or a nested listing
        yield " ".join(ln.strip() for ln in lines)


def is_prose(text: str) -> bool:
    words = text.split()
    if not 15 <= len(words) <= 300 or not text.endswith((".", "?", "!")) or CODE.search(text):
        return False
    return sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.9  # mostly words


def docstrings(lib: str):
    """Docstrings of the standard library's modules, classes and functions, in a fixed order."""
    for root, dirs, files in os.walk(lib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few stdlib files are templates or other encodings
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield ast.get_docstring(node) or ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--texts", type=int, default=2500, help="paragraphs to write (default 2500)")
    ap.add_argument("--out", default=os.path.join(here, "generic.jsonl.gz"), help="gzip JSONL to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the docstring sample (default 0)")
    args = ap.parse_args()
    if args.texts < 1:
        ap.error(f"--texts must be at least 1, got {args.texts}")
    if not args.out.endswith(".jsonl.gz"):
        ap.error(f"--out must end in .jsonl.gz, got {args.out!r}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out: folder {os.path.dirname(os.path.abspath(args.out))!r} does not exist")

    # The documentation's prose first (it is the closest to "generic text about Python"),
    # then a seeded sample of docstring prose for the rest; no paragraph twice.
    docs = list(dict.fromkeys(p for k in sorted(topics) for p in paragraphs(topics[k]) if is_prose(p)))
    seen = set(docs)
    extra = [p for d in docstrings(os.path.dirname(os.__file__)) for p in paragraphs(d)
             if is_prose(p) and p not in seen and not seen.add(p)]
    if len(docs) + len(extra) < args.texts:
        sys.exit(f"build_generic: only {len(docs) + len(extra)} prose paragraphs found, asked for {args.texts}")
    texts = docs[:args.texts] + random.Random(args.seed).sample(extra, max(0, args.texts - len(docs)))
    random.Random(args.seed).shuffle(texts)

    part = args.out + ".part"
    with open(part, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        for t in texts:
            gz.write((json.dumps({"text": t}, ensure_ascii=False) + "\n").encode())
    os.replace(part, args.out)
    print(f"wrote {args.out}: {len(texts)} texts ({min(len(docs), args.texts)} from the docs' topics), "
          f"{os.path.getsize(args.out) / 1e6:.2f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
