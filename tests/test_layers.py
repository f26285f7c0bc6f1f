"""Imports run one way: formats -> kernels and runtime model -> engine and server -> stages ->
registry -> pipeline and CLI. No import points up a layer (function-level imports included),
no two packages import each other (directly or round a longer loop), and no private name
(`_x`) is imported from another package.

Every module must be placed in LAYERS: a new module that fits none fails here until it is.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"quantpipe": "quantpipe", "runtime": "quantpipe.runtime", "kernels/src": "quantpipe.kernels",
           "evals": "quantpipe.evals"}

FORMATS, MODEL, ENGINE, STAGES, REGISTRY, TOP = range(6)
NAMES = ["formats", "kernels and runtime model", "engine and server", "stages", "registry", "pipeline and CLI"]
# Longest matching prefix wins.
LAYERS = {
    "quantpipe.formats": FORMATS, "quantpipe.manifest": FORMATS,
    "quantpipe.runtime.model": MODEL, "quantpipe.runtime.utils": MODEL, "quantpipe.runtime.sampling_params": MODEL,
    "quantpipe.runtime.outputs": MODEL, "quantpipe.kernels": MODEL,
    "quantpipe.runtime": ENGINE, "quantpipe.runtime.engine": ENGINE,
    "quantpipe.runtime.model.runner": ENGINE,  # executes the scheduler's steps on the model "quantpipe.runtime.llm_engine": ENGINE,
    "quantpipe.runtime.llm": ENGINE, "quantpipe.runtime.server": ENGINE, "quantpipe.runtime.bench": ENGINE,
    "quantpipe.runtime.workload": ENGINE, "quantpipe.runtime.cli": ENGINE,
    "quantpipe.distributed": ENGINE,  # Ray: where stages' tasks run
    "quantpipe.evals": FORMATS,  # data only (suites, policies, recipes, task files): its __init__ locates them
    "quantpipe.calibrate": STAGES, "quantpipe.quantize": STAGES, "quantpipe.eval": STAGES,
    "quantpipe.gate": STAGES, "quantpipe.regression": STAGES,
    "quantpipe.kernels.build": STAGES, "quantpipe.kernels.cli": STAGES,  # the kernels build stage
    "quantpipe.registry": REGISTRY,
    "quantpipe.pipeline": TOP, "quantpipe.cli": TOP, "quantpipe.gate_cli": TOP, "quantpipe.__main__": TOP,
}


def layer_of(module: str) -> int | None:
    if module == "quantpipe":  # the package's own __init__: its version only
        return FORMATS
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def unit_of(module: str) -> str:
    """The package a module belongs to for the no-loops rule: a subpackage, or a top-level module."""
    depth = 3 if module.startswith("quantpipe.runtime.") else 2
    return ".".join(module.split(".")[:depth])


def sources() -> dict[str, str]:
    out = {}
    for folder, package in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    rel = rel.removesuffix("__init__").rstrip(".")
                    out[f"{package}.{rel}" if rel else package] = open(os.path.join(dirpath, f)).read()
    return out


def imports(modules: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(importer, imported module, imported name or None) for every import of quantpipe code."""
    out = []
    for mod, src in modules.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, None) for a in node.names if a.name.startswith("quantpipe")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("quantpipe"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.append((mod, sub, None) if sub in modules else (mod, node.module, a.name))
    return out


def violations(modules: dict[str, str]) -> list[str]:
    problems = [f"{m}: in no layer (add it to LAYERS)" for m in modules if layer_of(m) is None]
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, target, name in imports(modules):
        if layer_of(mod) is None or layer_of(target) is None:
            continue
        if layer_of(target) > layer_of(mod):
            problems.append(f"{mod} ({NAMES[layer_of(mod)]}) imports {target} ({NAMES[layer_of(target)]}): "
                            f"up a layer")
        if unit_of(mod) != unit_of(target):
            edges[unit_of(mod)].add(unit_of(target))
            if name and name.startswith("_") and not name.startswith("__"):
                problems.append(f"{mod} imports the private name {name} from {target}")
    # loops between packages: any strongly connected set of more than one
    index, low, stack, on, count = {}, {}, [], set(), [0]

    def visit(v: str) -> None:
        index[v] = low[v] = count[0]
        count[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                problems.append("packages import each other: " + " <-> ".join(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return problems


def test_the_code_follows_the_layers():
    modules = sources()
    assert "quantpipe.runtime.model.loader" in modules and "quantpipe.kernels.linear" in modules
    assert violations(modules) == []


def test_the_check_catches_a_planted_upward_import_a_loop_and_a_private_name():
    modules = sources()
    planted = dict(modules)
    planted["quantpipe.runtime.model.loader"] += "\n\ndef _f():\n    from quantpipe.registry import publish\n"
    found = violations(planted)
    assert any("quantpipe.runtime.model.loader (kernels and runtime model) imports quantpipe.registry" in p
               for p in found), found
    planted = dict(modules)
    planted["quantpipe.gate"] += "\nfrom quantpipe.eval.stage import evaluate\n"  # eval imports gate? no: a loop
    planted["quantpipe.eval.stage"] += "\nfrom quantpipe.gate import judge\n"
    assert any(p.startswith("packages import each other") and "quantpipe.eval" in p and "quantpipe.gate" in p
               for p in violations(planted))
    planted = dict(modules)
    planted["quantpipe.eval.stage"] += "\nfrom quantpipe.calibrate.stage import _records\n"
    assert any("private name _records" in p for p in violations(planted))
    planted = {**modules, "quantpipe.newthing": "x = 1\n"}
    assert "quantpipe.newthing: in no layer (add it to LAYERS)" in violations(planted)


# The bottom layer reads and writes files: the standard library and the libraries of the
# formats themselves (tensors, safetensors files, YAML), nothing heavier.
FORMAT_DEPENDENCIES = {"torch", "safetensors", "yaml"}


def third_party_imports(src: str) -> set[str]:
    import sys

    out = set()
    for node in ast.walk(ast.parse(src)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        out |= {n.split(".")[0] for n in names}
    return {n for n in out if n not in sys.stdlib_module_names and n not in ("quantpipe", "__future__")}


def test_the_formats_layer_needs_only_torch_safetensors_and_yaml():
    modules = sources()
    formats = {m: src for m, src in modules.items() if layer_of(m) == FORMATS and not m.startswith("quantpipe.evals")}
    assert "quantpipe.formats.artifact" in formats and "quantpipe.manifest" in formats
    extra = {m: sorted(third_party_imports(src) - FORMAT_DEPENDENCIES) for m, src in formats.items()}
    assert {m: e for m, e in extra.items() if e} == {}
    assert third_party_imports("import numpy as np\nfrom transformers import AutoTokenizer\n") == \
        {"numpy", "transformers"}
