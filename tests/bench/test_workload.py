"""WorkloadSpec loading/validation, length distributions, presets, traces, materialization."""

import json

import numpy as np
import pytest

from quantpipe.runtime.workload import (
    ApproxTokenizer,
    WorkloadSpec,
    load_workload,
    materialize,
    preset,
    sample_requests,
)


@pytest.mark.parametrize("d, msg", [
    ({"prompt_tokens": {"dist": "lognormal", "median": 100, "sigma": -1}},
     "workload.prompt_tokens.sigma must be > 0, got -1"),
    ({"output_tokens": {"dist": "zipf"}}, "workload.output_tokens.dist must be one of"),
    ({"prompt_tokens": {"dist": "uniform", "low": 10, "high": 5}}, "workload.prompt_tokens.high must be >= low"),
    ({"prompt_tokens": {"dist": "fixed", "value": 10, "min": 20, "max": 5}}, "workload.prompt_tokens.max must be >= min"),
    ({"arrival": {"process": "gamma", "rate": 2}}, "workload.arrival.cv is required"),
    ({"arrival": {"process": "poisson", "rate": 0}}, "workload.arrival.rate must be > 0, got 0"),
    ({"arrival": {"process": "diurnal", "valley": 5, "peak": 2}}, "workload.arrival.valley must be in [0, peak=2.0]"),
    ({"shared_prefix": {"num_prefixes": 2, "prefix_tokens": 8, "fraction": 1.5}},
     "workload.shared_prefix.fraction must be in [0, 1], got 1.5"),
    ({"num_requests": 0}, "workload.num_requests must be an integer >= 1"),
    ({"bogus": 1}, "workload: unknown field(s) ['bogus']"),
    ({"prompt_tokens": {"dist": "mixture", "components": [{"weight": -1, "dist": "fixed", "value": 3}]}},
     "workload.prompt_tokens.components[0].weight must be > 0"),
])
def test_validation_errors_name_the_field(d, msg):
    with pytest.raises(ValueError) as e:
        WorkloadSpec.from_dict(d)
    assert msg in str(e.value)


def test_yaml_and_json_files_load_the_same(tmp_path):
    d = {"name": "t", "num_requests": 50, "prompt_tokens": {"dist": "normal", "mean": 100, "std": 10},
         "output_tokens": {"dist": "uniform", "low": 5, "high": 9}, "arrival": {"process": "gamma", "rate": 3, "cv": 2}}
    (tmp_path / "w.json").write_text(json.dumps(d))
    import yaml
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(d))
    a, b = load_workload(tmp_path / "w.json"), load_workload(str(tmp_path / "w.yaml"))
    assert a == b == WorkloadSpec.from_dict(a.to_dict())
    ra = sample_requests(a)
    assert [r.output_tokens for r in ra] == [r.output_tokens for r in sample_requests(b)]
    assert all(5 <= r.output_tokens <= 9 for r in ra)
    with pytest.raises(ValueError, match="neither a preset"):
        load_workload(tmp_path / "missing.yaml")


def test_empirical_from_file_and_mixture(tmp_path):
    (tmp_path / "lens.txt").write_text("10 20 30\n")
    spec = WorkloadSpec.from_dict({"num_requests": 3000,
                                   "prompt_tokens": {"dist": "empirical", "path": "lens.txt"},
                                   "output_tokens": {"dist": "mixture", "components": [
                                       {"weight": 3, "dist": "fixed", "value": 1},
                                       {"weight": 1, "dist": "fixed", "value": 100}]}}, base_dir=tmp_path)
    reqs = sample_requests(spec)
    assert {r.prompt_tokens for r in reqs} == {10, 20, 30}
    frac_short = np.mean([r.output_tokens == 1 for r in reqs])
    assert abs(frac_short - 0.75) < 0.03


def test_chat_cpu_preset_matches_spec():
    spec = preset("chat-cpu")
    reqs = sample_requests(spec)
    assert len(reqs) == 64 and spec.seed == 0 and spec.ignore_eos
    assert all(16 <= r.prompt_tokens <= 1536 and 8 <= r.output_tokens <= 384 for r in reqs)
    assert reqs == sample_requests(preset("chat-cpu"))  # deterministic
    big = sample_requests(preset("chat-cpu", num_requests=20000))
    assert abs(np.median([r.prompt_tokens for r in big]) / 256 - 1) < 0.05
    assert abs(np.median([r.output_tokens for r in big]) / 128 - 1) < 0.05
    small = sample_requests(preset("chat-cpu", length_scale=0.25))
    assert max(r.prompt_tokens for r in small) <= 384


def test_chat_and_code_presets_hit_published_percentiles():
    chat = sample_requests(preset("chat", num_requests=40000))
    p = np.percentile([r.prompt_tokens for r in chat], [50, 90, 99])
    assert np.allclose(p, [1020, 2734, 4142], rtol=0.05)
    o = np.percentile([r.output_tokens for r in chat], [50, 99])
    assert np.allclose(o, [129, 601], rtol=0.06)
    code = sample_requests(preset("code", num_requests=40000))
    assert np.allclose(np.percentile([r.prompt_tokens for r in code], [50, 99]), [1469, 7436], rtol=0.06)
    gaps = np.diff([r.arrival_s for r in code])
    assert 10 < gaps.std() / gaps.mean() < 16  # bursty, CV ~13
    ls = sample_requests(preset("long-short", num_requests=5000))
    # 20% long (lognormal median 6000, sigma 0.4: 68% of them >= 5000) + ~0.5% of chat prompts
    assert 0.11 < np.mean([r.prompt_tokens >= 5000 for r in ls]) < 0.17


def test_materialize_exact_and_deterministic():
    tok = ApproxTokenizer()
    reqs = materialize(preset("chat-cpu"), tok)
    assert len(reqs) == 64 and all(r.exact for r in reqs)
    assert all(len(tok.encode(r.prompt)) == r.spec.prompt_tokens for r in reqs)
    again = materialize(preset("chat-cpu"), tok)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]
    assert reqs[0].prompt != materialize(preset("chat-cpu"), tok, seed=1)[0].prompt


def test_shared_prefix_and_sessions():
    spec = WorkloadSpec.from_dict({"num_requests": 60, "prompt_tokens": 40, "output_tokens": 7,
                                   "shared_prefix": {"num_prefixes": 2, "prefix_tokens": 30, "fraction": 1.0},
                                   "sessions": {"turns": 3, "think_time_s": 2.0}})
    reqs = materialize(spec)
    by_index = {r.spec.index: r for r in reqs}
    groups = {}
    for r in reqs:
        assert r.exact
        if r.spec.turn == 0:
            assert r.spec.prompt_tokens == 70
            groups.setdefault(r.spec.prefix_group, set()).add(tuple(r.prompt_ids[:25]))
        else:
            parent = by_index[r.spec.parent]
            assert r.spec.prompt_tokens == parent.spec.prompt_tokens + 7 + 40
            assert r.spec.arrival_s >= parent.spec.arrival_s + 2.0 - 1e-9
            # later turn carries the conversation so far (first tokens identical)
            assert r.prompt_ids[:60] == parent.prompt_ids[:60]
    assert all(len(v) == 1 for v in groups.values()) and len(groups) == 2


def test_trace_replay_azure_and_mooncake(tmp_path):
    (tmp_path / "az.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                     "2023-11-16 18:15:46.6805900,100,10\n"
                                     "2023-11-16 18:15:47.1805900,200,20\n"
                                     "2023-11-16 18:15:50.6805900,300,30\n")
    spec = WorkloadSpec.from_dict({"num_requests": 10, "arrival": {"process": "trace", "path": str(tmp_path / "az.csv"),
                                                                   "time_scale": 0.5, "length_scale": 0.1}})
    reqs = sample_requests(spec)
    assert [round(r.arrival_s, 3) for r in reqs] == [0.0, 0.25, 2.0]
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(10, 1), (20, 2), (30, 3)]
    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in [
        {"timestamp": 0, "input_length": 50, "output_length": 5, "hash_ids": [1]},
        {"timestamp": 1500, "input_length": 60, "output_length": 6, "hash_ids": [1]}]))
    spec = WorkloadSpec.from_dict({"num_requests": 10, "arrival": {"process": "trace", "path": str(tmp_path / "mc.jsonl")}})
    reqs = sample_requests(spec)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 50, 5), (1.5, 60, 6)]


def test_datasets_sharegpt_and_jsonl(tmp_path):
    (tmp_path / "sg.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is a list?"}, {"from": "gpt", "value": "A sequence type."}]},
        {"conversations": [{"from": "human", "value": "Explain tuples please"}]}]))
    spec = WorkloadSpec.from_dict({"num_requests": 4, "output_tokens": 9,
                                   "dataset": {"path": str(tmp_path / "sg.json")}})
    tok = ApproxTokenizer()
    reqs = materialize(spec, tok)
    texts = {r.prompt for r in reqs}
    assert texts <= {"What is a list?", "Explain tuples please"}
    for r in reqs:
        if r.prompt == "What is a list?":
            assert r.output_tokens == len(tok.encode("A sequence type."))
        else:
            assert r.output_tokens == 9
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there", "output_tokens": 3}\n{"text": "x y"}\n')
    spec = WorkloadSpec.from_dict({"num_requests": 2, "dataset": {"path": str(tmp_path / "p.jsonl")}})
    assert sorted(r.prompt for r in materialize(spec, tok)) == ["hello there", "x y"]
