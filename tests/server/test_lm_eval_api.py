"""Stock lm-evaluation-harness against a real `quantpipe serve`: its `local-completions`
model (log-likelihoods from echoed prompt logprobs, tokenized by the server's own
/tokenize, batches of prompts per request) scores the shipped tasks as the in-process
`quantpipe` model does, and its
`local-chat-completions` model generates what `LLM.chat` generates."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

MODEL = "SmolLM2-135M-Instruct"
TASK = "quantpipe_bigbench_general_knowledge"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048")


def _run(model: str, model_args: str, tasks: list[str], include_path: str | None = None, **kwargs) -> dict:
    from lm_eval import simple_evaluate

    from quantpipe.eval.lm_eval_suite import task_manager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                           task_manager=task_manager(include_path), **kwargs)


def test_local_completions_scores_as_the_in_process_model(server):
    from lm_eval.api.instance import Instance

    from quantpipe.eval.lm_eval_model import QuantpipeLM

    # batch_size 16: lm-eval sends 16 prompts per request, one response with 16 choices.
    out = _run("local-completions", f"base_url={server.url}/v1/completions,model={MODEL},tokenizer_backend=remote",
               [TASK], limit=24, batch_size=16)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == 24
    # The same (context, continuation) requests, scored in process in float32 as the server does.
    pairs = [tuple(args) for s in samples for args in s["arguments"]]
    ours = QuantpipeLM(dtype="float32").loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i) for i, a in enumerate(pairs)])
    served = [(float(r[0][0]), bool(r[0][1])) for s in samples for r in s["resps"]]
    assert len(served) == len(ours) > 24
    # Paged, chunked float32 against one whole forward: equal up to float rounding.
    assert max(abs(a[0] - b[0]) for a, b in zip(served, ours)) < 1e-3
    assert [a[1] for a in served] == [b[1] for b in ours]
    per_item, i = [], 0
    for s in samples:  # lm-eval's acc from our log-likelihoods, item by item
        n = len(s["resps"])
        lls = [ll for ll, _ in ours[i:i + n]]
        per_item.append(float(lls.index(max(lls)) in s["target"] if isinstance(s["target"], list)
                              else lls.index(max(lls)) == s["target"]))
        i += n
    assert [s["acc"] for s in samples] == per_item
    assert 0 < out["results"][TASK]["acc,none"] < 1


def test_local_chat_completions_generates_what_llm_chat_generates(server, tmp_path):
    from quantpipe.runtime import LLM, SamplingParams

    questions = ["What is the capital of France?", "Name a primary color.", "How many legs does a spider have?"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"question": q, "answer": "-"}) + "\n" for q in questions))
    (tmp_path / "probe.yaml").write_text(f"""
task: chat_probe
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "q.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 16, do_sample: false}}
metric_list: [{{metric: exact_match}}]
metadata: {{version: 1.0}}
""")
    out = _run("local-chat-completions", f"base_url={server.url}/v1/chat/completions,model={MODEL}", ["chat_probe"],
               include_path=str(tmp_path), apply_chat_template=True)
    got = [s["resps"][0][0] for s in sorted(out["samples"]["chat_probe"], key=lambda s: s["doc_id"])]
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB")
    want = [r.outputs[0].text for r in llm.chat([[{"role": "user", "content": q}] for q in questions],
                                                SamplingParams(temperature=0, max_tokens=16, stop=["\n\n"]))]
    assert got == want and all(got)
