"""Named workloads. Length stats come from published traces; rates are defaults to override.

chat:   Azure LLM inference trace 2023, conversation: prompt median 1020 / p90 2734 /
        p99 4142, output median 129 / p99 601, near-Poisson arrivals.
code:   Azure 2023 code: prompt median 1469 / p99 7436, output median 13 / p99 251,
        very bursty (inter-arrival CV ~13).
long-short: 80% chat-like prompts, 20% long RAG prompts (median 6000 tokens).
shared-prefix: 8 system prompts of 1024 tokens in front of 90% of requests.
chat-cpu: 64 requests, seed 0, prompt lognormal(256, 0.8) in [16,1536], output
        lognormal(128, 0.7) in [8,384], exact lengths (ignore_eos) -- sized for a CPU box.

`length_scale` shrinks every length (e.g. 0.25 for a small machine).
"""

from __future__ import annotations

from quantpipe.runtime.workload.spec import WorkloadSpec

_CHAT_PROMPT = {
    # Piecewise log-linear through the published percentiles; the 0 and 1 knots (the
    # trace's min and a cap) are our choice, the 0.5/0.9/0.99 knots are the published ones.
    "dist": "quantiles", "points": {0: 16, 0.5: 1020, 0.9: 2734, 0.99: 4142, 1: 8192}, "min": 1, "max": 8192,
}
# lognormal sigma fitted so median and p99 match: sigma = ln(p99/median) / 2.326
_CHAT_OUTPUT = {"dist": "lognormal", "median": 129, "sigma": 0.661, "min": 1, "max": 2048}

PRESETS: dict[str, dict] = {
    "chat": {
        "name": "chat", "num_requests": 1000, "prompt_tokens": _CHAT_PROMPT, "output_tokens": _CHAT_OUTPUT,
        "arrival": {"process": "poisson", "rate": 1.0},
    },
    "code": {
        "name": "code", "num_requests": 1000,
        "prompt_tokens": {"dist": "lognormal", "median": 1469, "sigma": 0.697, "min": 1, "max": 16384},
        "output_tokens": {"dist": "lognormal", "median": 13, "sigma": 1.272, "min": 1, "max": 2048},
        "arrival": {"process": "gamma", "rate": 1.0, "cv": 13.0},
    },
    "long-short": {
        "name": "long-short", "num_requests": 1000,
        "prompt_tokens": {"dist": "mixture", "components": [
            {"weight": 0.8, **_CHAT_PROMPT},
            {"weight": 0.2, "dist": "lognormal", "median": 6000, "sigma": 0.4, "min": 2000, "max": 16000},
        ]},
        "output_tokens": _CHAT_OUTPUT,
        "arrival": {"process": "poisson", "rate": 1.0},
    },
    "shared-prefix": {
        "name": "shared-prefix", "num_requests": 1000,
        "prompt_tokens": {"dist": "lognormal", "median": 128, "sigma": 0.6, "min": 8, "max": 2048},
        "output_tokens": {"dist": "lognormal", "median": 128, "sigma": 0.6, "min": 8, "max": 1024},
        "arrival": {"process": "poisson", "rate": 1.0},
        "shared_prefix": {"num_prefixes": 8, "prefix_tokens": 1024, "fraction": 0.9},
    },
    "chat-cpu": {
        "name": "chat-cpu", "seed": 0, "num_requests": 64,
        "prompt_tokens": {"dist": "lognormal", "median": 256, "sigma": 0.8, "min": 16, "max": 1536},
        "output_tokens": {"dist": "lognormal", "median": 128, "sigma": 0.7, "min": 8, "max": 384},
        "ignore_eos": True,
        "arrival": {"process": "poisson", "rate": 1.0},
    },
}


def preset(name: str, *, length_scale: float = 1.0, rate: float | None = None,
           num_requests: int | None = None, seed: int | None = None) -> WorkloadSpec:
    """A preset workload, optionally with lengths scaled, rate or request count changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    d = dict(PRESETS[name])
    if num_requests is not None:
        d["num_requests"] = num_requests
    if seed is not None:
        d["seed"] = seed
    spec = WorkloadSpec.from_dict(d).scaled_lengths(length_scale)
    return spec.with_rate(rate) if rate is not None else spec
