"""The default gate's latency rules judge the CI of per-repeat paired ratios: the baseline
served against itself passes them, and the same model served on half the CPUs fails them."""

from __future__ import annotations

import numpy as np
import pytest

from quantpipe.eval.latency import KV_CACHE_MEMORY, compare, measure, ratio_ci, workload
from quantpipe.eval.stage import load_heldout
from quantpipe.gate import DEFAULT_POLICY, judge, load_policy
from quantpipe.runtime.server.process import Served, split_cpus

pytestmark = pytest.mark.timeout(1200)
# The default suite's repeats and concurrency with fewer, shorter requests (32 x 64 tokens
# there) so that 20 seeded A/Bs fit the test suite's budget; the same rules and thresholds.
CFG = {"repeats": 8, "requests": 8, "concurrency": 8, "max_output_tokens": 8, "rate": None}
SEEDS = 20


def test_ratio_ci_is_the_geometric_mean_with_a_bootstrap_interval():
    ci = ratio_ci([1.0, 1.0, 1.0])
    assert ci["point"] == ci["ci_lower"] == ci["ci_upper"] == 1.0 and ci["repeats"] == 3
    ci = ratio_ci([0.9, 1.1, 1.0, 1.3, 0.95])
    assert ci["point"] == pytest.approx(float(np.exp(np.mean(np.log([0.9, 1.1, 1.0, 1.3, 0.95])))))
    assert 0.9 < ci["ci_lower"] < ci["point"] < ci["ci_upper"] < 1.3
    assert (ci["min"], ci["max"], ci["median"]) == (0.9, 1.3, 1.0)
    assert ratio_ci([0.9, 1.1, 1.0, 1.3, 0.95]) == ci  # seeded: the same runs give the same interval
    # More spread, same centre: a wider interval, so a noisy A/B fails a bound the quiet one meets.
    wide = ratio_ci([0.7, 1.4, 1.0, 1.6, 0.8])
    assert wide["ci_upper"] - wide["ci_lower"] > ci["ci_upper"] - ci["ci_lower"]


def _latency_rules():
    rules = [r for r in load_policy(str(DEFAULT_POLICY))[0] if r.section == "latency"]
    assert {r.metric for r in rules} >= {"latency.tpot_p50_ratio", "latency.ttft_p99_ratio"}
    assert all(r.compare == "ci_upper" for r in rules if r.metric.endswith("_ratio"))
    return rules


def _judge(rules, section: dict) -> list[dict]:
    return judge({"scope": "latency"}, {"latency": section}, rules)


@pytest.mark.slow
def test_default_latency_rules_pass_the_baseline_against_itself_and_fail_half_the_cpus(sample_set):
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    half = split_cpus(2)[0]
    if half is None:
        pytest.skip("needs at least 2 CPUs to serve one side on half of them")
    rules = _latency_rules()
    rows, _ = load_heldout(sample_set, 256, 0)
    tokenizer = load_tokenizer(None)
    args = ["--kv-cache-memory", KV_CACHE_MEMORY]
    with Served(None, 2048, args) as a, Served(None, 2048, args) as b, Served(None, 2048, args, cpus=half) as slow:
        outcomes = []
        for seed in range(SEEDS):  # each seed draws other held-out prompts
            pick = np.random.default_rng(seed).choice(len(rows), CFG["requests"], replace=False)
            reqs = workload([rows[i] for i in pick], tokenizer, CFG["requests"], CFG["max_output_tokens"], 2048)
            runs = measure([a.url, b.url], reqs, CFG)["concurrency"]
            section = compare(runs[0], runs[1])
            outcomes.append({r["metric"]: (r["result"], round(r.get("value", float("nan")), 3))
                             for r in _judge(rules, section)})
        failed = [(seed, o) for seed, o in enumerate(outcomes) if any(res != "pass" for res, _ in o.values())]
        assert len(failed) <= 1, "seeds failing the latency rules:\n" + "\n".join(map(str, failed))
        runs = measure([a.url, slow.url], reqs, CFG)["concurrency"]
        judged = {r["metric"]: r for r in _judge(rules, compare(runs[0], runs[1]))}
    assert judged["latency.tpot_p50_ratio"]["result"] == "fail", judged
    assert judged["latency.error_rate"]["result"] == "pass", judged
