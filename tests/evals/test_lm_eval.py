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
