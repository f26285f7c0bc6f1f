"""The latency A/B on real servers: a closed loop at fixed concurrency and an open loop at a
fixed request rate, per-request samples kept for the report's CDFs."""

from __future__ import annotations

import pytest

from quantpipe.eval.html import _cdf, _latency
from quantpipe.eval.latency import at_rate, latency_ab, workload
from quantpipe.eval.stage import load_heldout
from quantpipe.eval.suite import EvalSuite
from quantpipe.manifest import StageError

pytestmark = pytest.mark.timeout(900)


def test_fixed_rate_spaces_arrivals_and_keeps_everything_else(sample_set):
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    rows, _ = load_heldout(sample_set, 8, 0)
    reqs = workload(rows, load_tokenizer(None), 6, 8, 2048)
    timed = at_rate(reqs, 4.0)
    assert [r.arrival_s for r in timed] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert [r.prompt_ids for r in timed] == [r.prompt_ids for r in reqs]
    assert [r.spec.output_tokens for r in timed] == [r.spec.output_tokens for r in reqs]
    assert all(r.arrival_s == 0.0 for r in reqs)  # the closed-loop requests are left as they were


def test_suite_rate_is_validated(tmp_path):
    for bad in ("0", "-1", "true", "'fast'"):
        path = tmp_path / "s.yaml"
        path.write_text(f"latency: {{rate: {bad}}}\n")
        with pytest.raises(StageError, match="latency.rate must be requests per second in \\(0, 1000\\]"):
            EvalSuite.load(str(path))


@pytest.mark.slow
def test_both_load_shapes_against_real_servers(sample_set, w8a16_artifact):
    rows, _ = load_heldout(sample_set, 8, 0)
    cfg = {"repeats": 1, "requests": 4, "concurrency": 2, "max_output_tokens": 4, "rate": 2.0}
    out = latency_ab(None, [w8a16_artifact], rows, cfg)
    (sec,) = out["candidates"]
    for shape in (sec, sec["at_rate"]):
        assert shape["error_rate"] == 0 and shape["tpot_p50_ratio"]["repeats"] == 1
        for run in shape["baseline_runs"] + shape["candidate_runs"]:
            assert run["completed"] == 4 and len(run["samples"]["ttft"]) == 4
            assert run["samples"]["ttft"] == sorted(run["samples"]["ttft"]) and min(run["samples"]["tpot"]) > 0
    assert sec["at_rate"]["rate_rps"] == 2.0 and sec["workload"]["concurrency"] == 2
    # 4 requests at 2/s: the last is sent 1.5 s after the first, so a run spans at least that
    run = sec["at_rate"]["baseline_runs"][0]
    assert run["output_tokens_per_s"] <= 4 * 4 / 1.5
    page = "".join(_latency(sec["at_rate"], "open loop, 2 requests/s"))
    assert page.count("<polyline") == 4 and "TTFT CDF" in page and "baseline (n=4)" in page


def test_cdf_draws_one_step_line_per_side():
    svg = _cdf({"baseline": [0.1, 0.2, 0.4], "candidate": [0.15, 0.3], "empty": []}, "TTFT CDF")
    assert svg.count("<polyline") == 2 and "candidate (n=2)" in svg and "0.4 s" in svg
    assert _cdf({"baseline": []}, "x") == ""
