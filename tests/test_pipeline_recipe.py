"""The pipeline recipe: every stage option reachable from plain data, validated before any
stage runs, with errors that name the key; and the gated search's bookkeeping."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser

import pytest

from quantpipe.manifest import StageError
from quantpipe.pipeline import DEFAULT_RECIPE, PipelineRecipe
from quantpipe.pipeline.cli import apply_flags
from quantpipe.quantize.config import QuantConfig

CALIB = {"recipe": "calib_sets/recipes/sample.yaml"}

# A valid value, other than the default, for every QuantConfig field (with what it needs
# beside it). A field added to QuantConfig without an entry here fails the test below.
NON_DEFAULT = {
    "scheme": ({"scheme": "W8A16"}, "W8A16"),
    "group_size": ({"group_size": 32}, 32),
    "symmetric": ({"symmetric": False}, False),
    "method": ({"method": "gptq"}, "gptq"),
    "clip": ({"clip": "mse"}, "mse"),
    "dampening": ({"dampening": 0.05}, 0.05),
    "block_size": ({"block_size": 64}, 64),
    "act_order": ({"act_order": False}, False),
    "iters": ({"method": "autoround", "iters": 50}, 50),
    "batch_size": ({"method": "autoround", "batch_size": 4}, 4),
    "learn_dtype": ({"method": "autoround", "learn_dtype": "float32"}, "float32"),
    "calib_samples": ({"calib_samples": 16}, 16),
    "calib_seq_len": ({"calib_seq_len": 256}, 256),
    "quantize_lm_head": ({"quantize_lm_head": True}, True),
    "dtype": ({"dtype": "float16"}, "float16"),
    "smoothquant_alpha": ({"scheme": "W8A8", "smoothquant_alpha": 0.5}, 0.5),
    "bits_budget": ({"scheme": "mixed", "bits_budget": 4.5}, 4.5),
    "sensitivity_samples": ({"scheme": "mixed", "bits_budget": 5, "sensitivity_samples": 2}, 2),
    "sensitivity_tokens": ({"scheme": "mixed", "bits_budget": 5, "sensitivity_tokens": 64}, 64),
    "kv_cache": ({"kv_cache": "fp8"}, "fp8"),
    "kv_cache_strategy": ({"kv_cache": "int8", "kv_cache_strategy": "channel"}, "channel"),
    "calibrate_all_experts": ({"method": "gptq", "calibrate_all_experts": True}, True),
    "rotations": ({"rotations": ["r4", "R1"]}, ("R1", "R4")),
    "hadamard_block_size": ({"rotations": ["R4"], "hadamard_block_size": 64}, 64),
    "mixed_bits": ({"scheme": "mixed", "bits_budget": 4.25, "mixed_bits": [8, 3, 4, 6]}, (3, 4, 6, 8)),
    "mixed_group_sizes": ({"scheme": "mixed", "bits_budget": 5, "mixed_group_sizes": [128, 64]}, (64, 128)),
}


def _recipe(candidates, **sections) -> PipelineRecipe:
    return PipelineRecipe.from_dict({"calibrate": CALIB, "candidates": candidates, **sections})


def test_every_quantize_field_is_reachable_from_a_recipe():
    fields = [f.name for f in dataclasses.fields(QuantConfig)]
    assert set(NON_DEFAULT) == set(fields), "a QuantConfig field has no recipe check"
    default = QuantConfig()
    for name in fields:
        given, expected = NON_DEFAULT[name]
        assert getattr(default, name) != expected, name
        (cand,) = _recipe([given]).candidates
        assert getattr(cand.config, name) == expected, name


def test_clip_defaults_to_each_methods_best_measured_grid():
    # GPTQ searches each group's range by the layer's output error; RTN keeps min-max (BENCHMARKS.md).
    assert QuantConfig().clip == "minmax" and QuantConfig(method="gptq").clip == "mse"
    assert QuantConfig(method="gptq", clip="minmax").clip == "minmax"
    (cand,) = _recipe([{"method": "gptq", "clip": None}]).candidates
    assert cand.config.clip == "mse" and cand.name == "w4a16-gptq-mse"  # the name says what it is
    (cand,) = _recipe([{"scheme": "mixed", "bits_budget": 4.25, "mixed_bits": [3, 4, 6, 8]}]).candidates
    assert cand.name == "mixed-4.25b-w3468-rtn"


def test_default_recipe_is_a_ladder_of_valid_candidates():
    r = PipelineRecipe.load()
    assert r.path == str(DEFAULT_RECIPE) and r.publish and r.calib_recipe
    schemes = {c.config.scheme for c in r.candidates}
    assert {"W4A16", "mixed", "W8A16", "W8A8"} <= schemes
    assert len({c.name for c in r.candidates}) == len(r.candidates)
    # The stage answers which of them read calibration data; the pipeline asks it. W8A8's
    # rotations need none.
    assert [c.name for c in r.candidates if not c.config.calibration_need()] == ["w8a8-r1r4"]


@pytest.mark.parametrize("model, name", [
    (None, "smollm2"), ("smollm2-135m", "smollm2"), ("gemma3-270m", "gemma3-270m"),
    ("models:/team-model@champion", "team-model"), ("models:/team-model/3", "team-model"),
    ("/data/My Model.Q4_K_M.gguf", "My-Model.Q4_K_M"), ("/data/llama-3.2-1b/", "llama-3.2-1b"),
])
def test_a_recipe_without_a_name_is_named_after_the_model(model, name):
    from quantpipe.pipeline.run import model_name

    assert model_name(model) == name
    assert PipelineRecipe.load().name is None  # the default recipe: so MODEL=gemma3-270m writes gemma3-270m/


@pytest.mark.parametrize("cfg, need", [
    ({"scheme": "W8A16", "method": "rtn"}, None),
    ({"scheme": "W4A16", "method": "awq"}, "AWQ"),
    ({"scheme": "W4A16", "method": "gptq"}, "GPTQ"),
    ({"scheme": "mixed", "bits_budget": 5}, "mixed precision"),
    ({"scheme": "W8A8", "smoothquant_alpha": 0.5}, "SmoothQuant"),
    ({"scheme": "W8A8"}, None),  # rotations by default: no calibration data
    ({"scheme": "W8A16", "kv_cache": "int8"}, None),
    ({"scheme": "W8A16", "kv_cache": "int8", "kv_cache_strategy": "channel"}, "static KV"),
])
def test_the_quantize_config_says_what_needs_calibration(cfg, need):
    got = QuantConfig.from_dict(cfg).calibration_need()
    assert (got is None) if need is None else got.startswith(need)


@pytest.mark.parametrize("data, message", [
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": CALIB, "gates": {}}, "unknown section 'gates'"),
    ({"candidates": [], "calibrate": CALIB}, "candidates must be a non-empty list"),
    ({"candidates": [{"schem": "W8A16"}], "calibrate": CALIB}, "candidates[0]: unknown key 'schem'; known: act_order"),
    ({"candidates": [{"scheme": "W8A16"}, {"scheme": "W5"}], "calibrate": CALIB},
     "candidates[1]: scheme must be one of W8A16, W4A16, W8A8, mixed; got 'W5'"),
    ({"candidates": [{"scheme": "W4A16", "group_size": "64"}], "calibrate": CALIB},
     "candidates[0].group_size: must be an integer or null"),
    ({"candidates": [{"scheme": "W4A16", "act_order": 1}], "calibrate": CALIB},
     "candidates[0].act_order: must be true or false"),
    ({"candidates": [{"scheme": "mixed"}], "calibrate": CALIB}, "candidates[0]: scheme mixed needs bits_budget"),
    ({"candidates": [{"scheme": "W4A16", "calibrate_all_experts": True}], "calibrate": CALIB},
     "candidates[0]: calibrate_all_experts chooses the tokens of GPTQ's and AWQ's Hessians; method is 'rtn'"),
    ({"candidates": [{"scheme": "W8A16"}, {"scheme": "W8A16"}], "calibrate": CALIB},
     "candidates[1].name: 'w8a16-rtn' is used by another candidate"),
    ({"candidates": [{"scheme": "W8A16", "name": "a/b"}], "calibrate": CALIB}, "candidates[0].name must be"),
    ({"candidates": [{"scheme": "W8A16", "name": "quality"}], "calibrate": CALIB}, "a name the pipeline's own"),
    ({"candidates": [{"scheme": "W8A16", "name": "latency-x"}], "calibrate": CALIB}, "a name the pipeline's own"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": {**CALIB, "sise": 3}}, "unknown key calibrate.sise"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": {**CALIB, "size": 0}}, "size must be an integer >= 1"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": {"set": "x", "size": 3}}, "calibrate.set"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": {}}, "calibrate needs `recipe`"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": CALIB, "kernels": {"build": "always"}},
     "kernels.build must be one of auto, off"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": CALIB, "eval": {"suit": "x"}}, "unknown key eval.suit"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": CALIB, "eval": {"kv_tokens": -1}}, "eval.kv_tokens"),
    ({"candidates": [{"scheme": "W8A16"}], "calibrate": CALIB, "publish": {"enabled": "yes"}},
     "publish.enabled must be true or false"),
])
def test_bad_recipes_are_refused_naming_the_key(data, message):
    with pytest.raises(StageError) as e:
        PipelineRecipe.from_dict(data)
    assert message in str(e.value)


def test_recipe_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("candidates: [{scheme: W8A16}]\ncalibrate: {recipe: calib_sets/recipes/sample.yaml}\nnmae: x\n")
    with pytest.raises(StageError, match=re.escape(f"--recipe {bad}: unknown section 'nmae'")):
        PipelineRecipe.load(str(bad))
    with pytest.raises(StageError, match="--recipe"):
        PipelineRecipe.load(str(tmp_path / "missing.yaml"))


def test_flags_override_the_recipe():
    r = PipelineRecipe.load()
    one = apply_flags(r, name="mine", calib="some-set", policy="p.yaml", publish=False,
                      candidate={"scheme": "W8A16", "method": None, "group_size": None, "clip": "mse",
                                 "kv_cache": None, "bits_budget": None})
    assert one.name == "mine" and one.calib_set == "some-set" and one.policy == "p.yaml" and not one.publish
    (cand,) = one.candidates
    assert cand.name == "w8a16-rtn-mse" and cand.config.clip == "mse"
    logs = apply_flags(r, logs=["a.jsonl"])
    assert logs.calib_fields["logs"] == ["a.jsonl"] and logs.calib_recipe == r.calib_recipe
    assert [c.name for c in apply_flags(r).candidates] == [c.name for c in r.candidates]
    with pytest.raises(StageError, match="--name"):
        apply_flags(r, name="../x")
    with pytest.raises(StageError, match="flags .*bits_budget"):
        apply_flags(r, candidate={"scheme": "mixed"})


# --- the search's bookkeeping, on a made-up quality report --------------------------------

def _cand(name: str, weight_bytes: int, kv: int, kl: float, ppl: float) -> dict:
    ci = lambda v: {"point": v, "ci_lower": v * 0.8, "ci_upper": v * 1.2}  # noqa: E731
    return {"name": name, "path": f"artifacts/x/{name}", "sha256": name * 4, "weights": "W", "method": "rtn",
            "memory": {"weight_file_bytes": weight_bytes, "kv_bytes_per_token": kv, "weight_bytes_ratio": 0.5},
            "quality": {"kl_mean": ci(kl), "ppl_delta_pct": ci(ppl), "top1_agreement": ci(0.97), "strata": {}}}


def _policy(tmp_path) -> str:
    p = tmp_path / "policy.yaml"
    p.write_text("rules:\n"
                 "- {metric: quality.kl_mean, compare: ci_upper, op: '<=', threshold: 0.01}\n"
                 "- {metric: quality.ppl_delta_pct, compare: ci_upper, op: '<=', threshold: 1.0}\n"
                 "- {metric: latency.ttft_p99_ratio, compare: point, op: '<=', threshold: 1.25}\n")
    return str(p)


def test_search_orders_by_serving_bytes_and_explains_the_winner(tmp_path):
    from quantpipe.pipeline import search

    report = {"scope": "quality", "candidates": [
        _cand("w8", 200, 10, 0.001, 0.1), _cand("w4", 100, 10, 0.3, 20.0), _cand("w8-kv8", 200, 5, 0.002, 0.2)]}
    table = search.quality_table(report, _policy(tmp_path), kv_tokens=10)
    assert [r["name"] for r in table] == ["w4", "w8-kv8", "w8"]  # 200, 250, 300 bytes
    assert [r["quality_result"] for r in table] == ["fail", "pass", "pass"]
    assert table[0]["failed"][0].startswith("quality.kl_mean (ci_upper) = 0.36")
    assert table[1]["quality_rules"] == 2  # the latency rule waits for the A/B
    # The cheapest quality pass failed latency; the next one passed the whole gate.
    table[1].update(search.final_row({"verdict": "fail", "problems": [], "rules": [
        {"metric": "latency.ttft_p99_ratio", "compare": "point", "op": "<=", "threshold": 1.25, "value": 1.4,
         "result": "fail"}]}))
    table[2].update(search.final_row({"verdict": "pass", "problems": [], "rules": [
        {"metric": "latency.ttft_p99_ratio", "compare": "point", "op": "<=", "threshold": 1.25, "value": 1.1,
         "result": "pass"}]}))
    recipe = _recipe([{"scheme": "W8A16"}])
    doc = search.write_report(tmp_path / "out", recipe, table, table[2], "models:/x/1", _policy(tmp_path))
    assert doc["exit_code"] == 0 and doc["winner"] == "w8"
    assert "w4 (quality.kl_mean" in doc["why"] and "w8-kv8 (latency.ttft_p99_ratio (point) = 1.4" in doc["why"]
    assert [c["status"] for c in doc["candidates"]] == ["fail", "fail", "pass"]

    page = parse_search_page((tmp_path / "out" / "search.html").read_text())
    for metric in ("quality.kl_mean", "quality.ppl_delta_pct"):
        assert sorted(page.points[metric]) == ["w4", "w8", "w8-kv8"], metric  # one point per candidate
        assert page.bounds[metric] == ["0.01" if metric.endswith("kl_mean") else "1"]  # the gate's bound drawn
    assert page.rows == 3 and "winner: w8" in page.text


def test_search_exit_codes_and_closest(tmp_path):
    from quantpipe.pipeline import search

    report = {"scope": "quality", "candidates": [_cand("a", 100, 0, 0.3, 20.0), _cand("b", 200, 0, 0.02, 0.5)]}
    table = search.quality_table(report, _policy(tmp_path), kv_tokens=0)
    assert search.exit_code(table, None) == 1
    assert search.closest(table)["name"] == "b"  # one failing rule against two
    report["candidates"][1]["quality"].pop("kl_mean")  # a metric the report lacks: cannot judge, never a pass
    table = search.quality_table(report, _policy(tmp_path), kv_tokens=0)
    assert table[1]["quality_result"] == "cannot_judge" and search.exit_code(table, None) == 2
    doc = search.write_report(tmp_path / "o", _recipe([{"scheme": "W8A16"}]), table, None, None, _policy(tmp_path))
    assert doc["winner"] is None and doc["closest"]["name"] == "b"
    assert "no candidate passed the gate" in (tmp_path / "o" / "search.html").read_text()


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.points, self.bounds, self.rows, self.text, self._svg = {}, {}, 0, "", None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "data-metric" in a:
            self._svg = a["data-metric"]
            self.points[self._svg], self.bounds[self._svg] = [], []
        elif tag == "g" and a.get("class") == "candidate":
            self.points[self._svg].append(a["data-name"])
        elif tag == "line" and a.get("class") == "bound":
            self.bounds[self._svg].append(a["data-threshold"])
        elif tag == "tr":
            self.rows += 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self._svg = None

    def handle_data(self, data):
        self.text += data


def parse_search_page(text: str) -> _Page:
    """search.html's frontier points and gate bounds per plot, its table rows and its text."""
    page = _Page()
    page.feed(text)
    page.rows -= 1  # the header row
    return page
