"""Workload descriptions shared by the load generator, simulator and planner.

Plain data + numpy; nothing here talks HTTP except the optional HTTPTokenizer.

Numbers only (simulator / planner):

    from quantpipe.runtime.workload import preset, sample_requests
    reqs = sample_requests(preset("chat", rate=4.0))      # list[RequestSpec]
    reqs[0].arrival_s, reqs[0].prompt_tokens, reqs[0].output_tokens, reqs[0].prefix_group

Prompts as token ids (engine benchmark):

    from quantpipe.runtime.workload import preset, materialize, get_tokenizer
    tok = get_tokenizer("local")            # quantpipe.runtime.model.tokenizer.load_tokenizer(None)
    reqs = materialize(preset("chat-cpu"), tok)            # list[Request], deterministic
    batch = [(r.prompt_ids, r.output_tokens) for r in reqs]  # exact lengths, ignore_eos

Any object with encode(text) -> list[int] and decode(ids) -> str works as a tokenizer;
`get_tokenizer("server", base_url=...)` uses a server's /tokenize, "approx" needs nothing.

Specs: `load_workload(path_or_dict_or_preset_name)`; see spec.py for the format, and
`WorkloadSpec.with_rate(r)` / `.scaled_lengths(f)` / `preset(name, length_scale=...)`.
"""

from quantpipe.runtime.workload.arrivals import ArrivalSpec, Burst
from quantpipe.runtime.workload.lengths import LengthDist
from quantpipe.runtime.workload.materialize import Request, materialize
from quantpipe.runtime.workload.presets import PRESETS, preset
from quantpipe.runtime.workload.requests import RequestSpec, sample_requests
from quantpipe.runtime.workload.spec import Dataset, Sessions, SharedPrefix, WorkloadSpec, load_workload
from quantpipe.runtime.workload.text import (
    ApproxTokenizer,
    HTTPTokenizer,
    LocalTokenizer,
    corpus_text,
    get_tokenizer,
    load_dataset,
)

__all__ = [
    "ApproxTokenizer", "ArrivalSpec", "Burst", "Dataset", "HTTPTokenizer", "LengthDist", "LocalTokenizer",
    "PRESETS", "Request", "RequestSpec", "Sessions", "SharedPrefix", "WorkloadSpec", "corpus_text",
    "get_tokenizer", "load_dataset", "load_workload", "materialize", "preset", "sample_requests",
]
