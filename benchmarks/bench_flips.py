"""Calibration of the default gate's multiple-choice flips rule: the default suite's
multiple-choice items (through lm-eval, as `quantpipe eval` scores them) for the default
model in float32 against the gate tests' candidates (tests/evals/broken.py: W8A16 RTN, a
static INT8 KV cache, and the broken ones) and W4A16 group-64 RTN. Prints, per candidate,
the items whose correctness flipped (share with its paired bootstrap 95% CI, over all
items and per task), the accuracy drop and the seconds it took.

    .venv/bin/python -m benchmarks.bench_flips [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from quantpipe.calibrate import CalibConfig, calibrate
from quantpipe.eval import lm_eval_suite, mc
from quantpipe.eval.suite import EvalSuite
from quantpipe.quantize import QuantConfig, quantize
from quantpipe.runtime.model.loader import load_model
from tests.evals import broken

ROOT = Path(__file__).resolve().parent.parent


def _fmt(ci: dict) -> str:
    return f"{ci['point']:.2f} [{ci['ci_lower']:.2f}, {ci['ci_upper']:.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="folder for the artifacts (default: a temporary one)")
    args = ap.parse_args()
    tmp = Path(args.out or tempfile.mkdtemp(prefix="bench-flips-"))
    tmp.mkdir(parents=True, exist_ok=True)
    suite = EvalSuite.load()
    tasks, limit, q = suite.mc["tasks"], suite.mc["limit"], suite.quality

    os.chdir(ROOT)  # the recipe names its log relative to the project
    calib = tmp / "sample-set"
    if not calib.exists():
        calibrate(CalibConfig.from_recipe("calib_sets/recipes/sample.yaml", out=str(calib)))
    w8 = tmp / "w8a16-src"
    if not w8.exists():
        quantize(None, QuantConfig(scheme="W8A16"), None, str(w8))
    cands = broken.build(tmp / "cands", str(calib), str(w8)) if not (tmp / "cands").exists() else {
        p.name: str(p) for p in sorted((tmp / "cands").iterdir())}
    w4 = tmp / "w4g64-rtn"
    if not w4.exists():
        quantize(None, QuantConfig(scheme="W4A16", group_size=64), None, str(w4))
    cands["w4g64-rtn"] = str(w4)

    base_model, _, tok = load_model(None, torch.float32)
    lm_eval_suite.task_manager(None, defaults=False)
    t = time.perf_counter()
    base = lm_eval_suite.score_mc(base_model, tok, None, tasks, limit)
    accs = ", ".join(f"{k} {sum(v['acc']) / len(v['acc']):.3f}" for k, v in base.items())
    print(f"baseline: {sum(len(v['acc']) for v in base.values())} items in {time.perf_counter() - t:.0f} s; "
          f"acc {accs}", flush=True)
    rows = {}
    for name, path in cands.items():
        model = load_model(path, torch.float32)[0]
        t = time.perf_counter()
        res = lm_eval_suite.score_mc(model, tok, path, tasks, limit)
        secs = time.perf_counter() - t
        s = mc.summarize({k: {"baseline": base[k], "candidate": res[k]} for k in tasks}, "baseline", "candidate",
                         q["bootstrap"], q["seed"])
        rows[name] = s
        per_task = "; ".join(f"{k} {_fmt(v['flips_pct'])}" for k, v in s["tasks"].items())
        print(f"{name:14s} flips % {_fmt(s['flips_pct'])} (to wrong {s['flips']['to_wrong']}, to right "
              f"{s['flips']['to_right']}); acc drop points {s['accuracy_drop_points']['point']:.2f} "
              f"(CI upper {s['accuracy_drop_points']['ci_upper']:.2f}); per task: {per_task}; {secs:.0f} s",
              flush=True)
        del model
    (tmp / "flips.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
