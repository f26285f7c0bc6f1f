"""The runtime as an lm-evaluation-harness model (real lm-eval): `quantpipe lm-eval` on the
shipped tasks scores the items `quantpipe eval` scores, to the digit; rolling
log-likelihood and generation agree with HF transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantpipe.eval import mc

lm_eval = pytest.importorskip("lm_eval")
TASK = "general_knowledge"


def test_lm_eval_cli_gives_quantpipe_evals_accuracies_item_by_item(w8a16_artifact, tmp_path):
    from quantpipe.runtime.model.loader import load_model

    proc = subprocess.run(
        [sys.executable, "-m", "quantpipe", "lm-eval", "--model", "quantpipe",
         "--model_args", f"pretrained={w8a16_artifact},dtype=float32", "--tasks", f"quantpipe_bigbench_{TASK}",
         "--limit", "24", "--log_samples", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = (tmp_path / "out").glob("*/results_*.json")
    (samples,) = (tmp_path / "out").glob(f"*/samples_quantpipe_bigbench_{TASK}_*.jsonl")
    got = json.loads(results.read_text())["results"][f"quantpipe_bigbench_{TASK}"]
    per_item = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])

    model, _, tok = load_model(w8a16_artifact, torch.float32)
    ours = mc.evaluate({"w8": model}, tok, [TASK], 24)[TASK]["w8"]
    assert [s["acc"] for s in per_item] == ours["acc"] and [s["acc_norm"] for s in per_item] == ours["acc_norm"]
    assert got["acc,none"] == sum(ours["acc"]) / 24 and got["acc_norm,none"] == sum(ours["acc_norm"]) / 24
    # The prompts lm-eval built are the ones quantpipe's reader builds.
    items = mc.load_task(TASK, 24)
    assert [s["arguments"]["gen_args_0"]["arg_0"] for s in per_item] == [it.context for it in items]
    assert 0 < got["acc,none"] < 1  # a task that separates: some items right, some wrong


@pytest.fixture(scope="module")
def lm():
    from quantpipe.eval.lm_eval_model import QuantpipeLM

    return QuantpipeLM(dtype="float32", max_length=48)


def _requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_rolling_loglikelihood_is_hf_transformers_over_the_same_windows(lm, hf_default, corpus_prompts):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    text = corpus_prompts[5][:600]
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2 * lm.max_length  # several windows
    (got,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    want = 0.0
    with torch.no_grad():
        for context, target in map(make_disjoint_window, get_rolling_token_windows(
                ids, prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)):
            seq = torch.tensor([context + target])
            logp = torch.log_softmax(hf_default(seq).logits[0, -len(target) - 1:-1].double(), -1)
            want += float(logp.gather(1, torch.tensor(target).unsqueeze(1)).sum())
    assert abs(got - want) < 1e-4 * abs(want), (got, want)


def test_generate_until_stops_where_hf_greedy_text_reaches_the_stop_string(lm, hf_default):
    from tests.conftest import hf_greedy

    prompt = "Q: Name three primary colors.\nA:"
    (got,) = lm.generate_until(_requests("generate_until", [(prompt, {"until": ["\n"], "max_gen_toks": 24})]))
    ids = lm.tokenizer.encode(prompt)
    (ref,) = hf_greedy(hf_default, [ids], [24])
    want = lm.tokenizer.decode(ref).split("\n")[0]
    assert got == want and got.strip()


def test_bad_model_args_are_named():
    from quantpipe.eval.lm_eval_model import QuantpipeLM

    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        QuantpipeLM(dtype="float16")
    with pytest.raises(ValueError, match=r"takes pretrained, dtype, max_length; got \['trust_remote_code'\]"):
        QuantpipeLM.create_from_arg_string("trust_remote_code=True")
    assert Path(mc.TASK_DIR).is_dir()


def test_a_bad_task_file_is_named(tmp_path):
    import gzip

    from quantpipe.formats.bigbench import BigBenchError, read_task

    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(b'{"examples": [')[:-4])
    with pytest.raises(BigBenchError, match="cut.json.gz: not a readable gzipped BIG-bench task.json"):
        read_task(tmp_path / "cut.json.gz")
    (tmp_path / "gen.json.gz").write_bytes(gzip.compress(json.dumps(
        {"examples": [{"input": "2+2?", "target_scores": {"4": 1, "5": 0}}, {"input": "x", "target": "y"}]}).encode()))
    with pytest.raises(BigBenchError, match="gen.json.gz: example 1 has no 'input' text or no 'target_scores'"):
        read_task(tmp_path / "gen.json.gz")
    (first,) = read_task(tmp_path / "gen.json.gz", limit=1)
    assert first.context == "Q: 2+2?\nA:" and first.choices == ["4", "5"] and first.correct == {0}


def _items(values, requests=None):
    return {"metric": "acc", "filter": "none",
            "items": [{"doc_id": i, "value": float(v), "request": (requests or {}).get(i, f"q{i}")}
                      for i, v in enumerate(values)]}


def test_recovery_and_flips_are_counted_per_item_with_paired_intervals():
    from quantpipe.eval.lm_eval_suite import compare
    from quantpipe.manifest import StageError

    base = {"t": _items([1, 1, 0, 0, 1, 1, 0, 1])}
    cand = {"t": _items([1, 0, 1, 0, 1, 0, 0, 1])}
    (got,) = compare(base, cand, 400, 0).values()
    assert got["n"] == 8 and got["flips"] == {"to_wrong": 2, "to_right": 1}
    assert got["flips_pct"]["point"] == 100 * 3 / 8 and got["recovery"]["point"] == 0.5 / 0.625
    for m in ("flips_pct", "recovery"):
        assert got[m]["ci_lower"] <= got[m]["point"] <= got[m]["ci_upper"] and got[m]["ci_lower"] < got[m]["ci_upper"]
    assert got["baseline"]["point"] == 0.625 and got["candidate"]["point"] == 0.5
    same = compare(base, base, 400, 0)["t"]
    assert same["flips_pct"] == {"point": 0.0, "ci_lower": 0.0, "ci_upper": 0.0} and same["recovery"]["point"] == 1
    # A real-valued metric has a recovery and no flips; a baseline at 0 has no recovery.
    graded = compare({"t": _items([0.5, 1.0])}, {"t": _items([0.25, 1.0])}, 400, 0)["t"]
    assert "flips_pct" not in graded and graded["recovery"]["point"] == 1.25 / 1.5
    assert "recovery" not in compare({"t": _items([0, 0])}, {"t": _items([1, 0])}, 400, 0)["t"]
    with pytest.raises(StageError, match="not sent identical requests"):
        compare(base, {"t": _items([1] * 8, {3: "another prompt"})}, 400, 0)


@pytest.mark.slow
def test_eval_reports_lm_eval_tasks_and_the_gate_judges_them(w8a16_artifact, sample_set, tmp_path):
    from quantpipe.eval.stage import evaluate
    from quantpipe.eval.suite import EvalSuite
    from quantpipe.gate import gate

    task = f"quantpipe_bigbench_{TASK}"
    (tmp_path / "suite.yaml").write_text(
        "quality: {max_texts: 4, max_tokens: 32, bootstrap: 200}\ngeneration: {prompts: 0}\n"
        f"mc: {{tasks: [{TASK}], limit: 16}}\nlm_eval: {{tasks: [{task}], limit: 16}}\n")
    rep = evaluate([w8a16_artifact], sample_set, str(tmp_path / "r"), suite=EvalSuite.load(str(tmp_path / "suite.yaml")),
                   scope="quality")
    (c,) = rep["candidates"]
    got, mc_task = c["lm_eval"][task], c["mc"]["tasks"][TASK]
    # The multiple-choice section (run through lm-eval) holds, item by item, what the
    # eval's own loop scores without lm-eval.
    from quantpipe.runtime.model.loader import load_model

    base, _, tok = load_model(None, torch.float32)
    ours = mc.evaluate({"b": base, "c": load_model(w8a16_artifact, torch.float32)[0]}, tok, [TASK], 16)[TASK]
    by_hand = mc.summarize({TASK: {"baseline": ours["b"], "candidate": ours["c"]}}, "baseline", "candidate", 200, 0)
    assert mc_task == by_hand["tasks"][TASK]
    assert c["mc"]["flips_pct"] == by_hand["flips_pct"] == mc_task["flips_pct"]  # one task: pooled = per task
    # The lm_eval section names the same 16 items: the same numbers under lm-eval's names.
    assert got["n"] == 16 and got["metric"] == "acc"
    assert got["baseline"]["point"] == mc_task["acc_baseline"]["point"]
    assert got["candidate"]["point"] == mc_task["acc_candidate"]["point"]
    for m in ("flips", "flips_pct", "recovery"):
        assert mc_task[m] == got[m], m
    assert "lm-eval tasks" in (tmp_path / "r" / "report.html").read_text()
    policy = tmp_path / "p.yaml"
    policy.write_text(f"rules:\n- {{metric: lm_eval.{task}.flips_pct, compare: ci_upper, op: '<=', threshold: 100}}\n"
                      f"- {{metric: lm_eval.{task}.recovery, compare: ci_lower, op: '>=', threshold: 0}}\n")
    code, doc = gate(str(tmp_path / "r"), str(policy), out=str(tmp_path / "v.json"))
    assert code == 0 and [r["result"] for r in doc["rules"]] == ["pass", "pass"], doc["rules"]
    policy.write_text("rules:\n- {metric: lm_eval.no_such_task.flips_pct, compare: ci_upper, op: '<=', threshold: 5}\n")
    assert gate(str(tmp_path / "r"), str(policy), out=str(tmp_path / "v2.json"))[0] == 2  # missing: cannot judge


def test_suite_lm_eval_section_is_validated(tmp_path):
    from quantpipe.eval.suite import EvalSuite
    from quantpipe.manifest import StageError

    for body, message in (("lm_eval: {tasks: quantpipe_bigbench_navigate}", "lm_eval.tasks must be a list"),
                          ("mc: {tasks: [hellaswag]}", "mc.tasks: 'hellaswag' not shipped; known: date_understanding"),
                          ("lm_eval: {tasks: [a, a]}", "names a task twice"),
                          ("lm_eval: {tasks: [a], limit: 0}", r"lm_eval.limit must be an integer in \[1, 100000\]"),
                          ("lm_eval: {tasks: [a], num_fewshot: -1}", r"lm_eval.num_fewshot must be an integer"),
                          ("lm_eval: {tasks: [a], shots: 5}",
                           r"lm_eval takes \[.include_path., .limit., .num_fewshot., .tasks.\]"),
                          ("lm_eval: {tasks: [a], include_path: nowhere}",
                           "lm_eval.include_path .nowhere. is not a folder")):
        (tmp_path / "s.yaml").write_text(body + "\n")
        with pytest.raises(StageError, match=message):
            EvalSuite.load(str(tmp_path / "s.yaml"))


def test_a_suite_reaches_a_teams_own_task_through_include_path(tmp_path):
    """A team's task over its own local data (lm-eval's `dataset_path: json`), named by a
    suite whose include_path is relative to the suite file."""
    from quantpipe.eval.lm_eval_suite import score_tasks
    from quantpipe.eval.suite import EvalSuite
    from quantpipe.runtime.model.loader import load_model

    tasks = tmp_path / "our-tasks"
    tasks.mkdir()
    rows = [{"q": "The capital of France is", "choices": [" Paris", " a banana"], "gold": 0},
            {"q": "Two plus two equals", "choices": [" four", " purple"], "gold": 0}]
    (tasks / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "ours.yaml").write_text(
        "task: our_capitals\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {tasks / 'items.jsonl'}}}}}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "suite.yaml").write_text("lm_eval: {tasks: [our_capitals], include_path: our-tasks}\n")
    suite = EvalSuite.load(str(tmp_path / "suite.yaml"))
    assert suite.lm_eval["include_path"] == str(tasks.resolve())
    model, _, tok = load_model(None, torch.float32)
    got = score_tasks(model, tok, None, suite.lm_eval)["our_capitals"]
    assert got["metric"] == "acc" and [r["doc_id"] for r in got["items"]] == [0, 1]
    want = [float(max(range(2), key=lambda i: mc.loglikelihoods(model, tok, r["q"], r["choices"])[i][0]) == 0)
            for r in rows]
    assert [r["value"] for r in got["items"]] == want
