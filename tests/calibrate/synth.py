"""Synthetic request logs with known strata and planted problems (for tests and benchmarks).

Texts are random word sequences drawn from Python's documentation vocabulary, so two
texts are never near-duplicates by accident; every planted problem is counted exactly.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field

PII_SAMPLES = {
    "EMAIL": lambda r: f"{r.choice(['ann', 'bo', 'cy'])}.{r.randrange(10**6)}@example{r.randrange(99)}.com",
    "PHONE": lambda r: f"+1 {r.randrange(200, 999)}-{r.randrange(200, 999)}-{r.randrange(1000, 9999)}",
    "CARD": lambda r: _luhn_card(r),
    "IP": lambda r: f"{r.randrange(1, 255)}.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(1, 255)}",
    "API_KEY": lambda r: "sk-" + "".join(r.choice("abcdefghijklmnopqrstuvwxyzABCDEF0123456789") for _ in range(32)),
    "BEARER_TOKEN": lambda r: "Bearer " + "".join(r.choice("abcdefghijklmnop0123456789") for _ in range(24)),
}


def _luhn_card(r: random.Random) -> str:
    digits = [4] + [r.randrange(10) for _ in range(14)]
    total = 0
    for i, d in enumerate(reversed(digits)):  # the check digit goes to the right of these
        d = d * 2 if i % 2 == 0 else d
        total += d - 9 if d > 9 else d
    digits.append((10 - total % 10) % 10)
    s = "".join(map(str, digits))
    return " ".join(s[i:i + 4] for i in range(0, 16, 4))


def vocabulary() -> list[str]:
    from pydoc_data.topics import topics

    words = sorted({w.lower() for t in topics.values() for w in t.split() if w.isalpha() and 3 <= len(w) <= 12})
    return words


@dataclass
class SynthLog:
    path: str
    shares: dict[str, int]  # task -> ok records (before planted duplicates)
    planted: dict[str, int] = field(default_factory=dict)
    pii: dict[str, list[str]] = field(default_factory=dict)


def write_log(path: str, n: int = 10000, tasks: dict[str, float] | None = None, seed: int = 0,
              exact_dups: int = 50, near_dups: int = 40, malformed: int = 20, failed: int = 60,
              short: int = 10, pii_each: int = 100, words: tuple[int, int] = (30, 90),
              conv_turns: int = 3) -> SynthLog:
    """A request log of `n` ok chat requests (plus the planted extras), labelled metadata.task."""
    r = random.Random(seed)
    vocab = vocabulary()
    tasks = tasks or {"qa": 0.5, "code": 0.3, "summarize": 0.19, "translate": 0.01}
    names = list(tasks)
    counts = {t: int(round(n * s)) for t, s in tasks.items()}
    counts[names[0]] += n - sum(counts.values())
    order = [t for t in names for _ in range(counts[t])]
    r.shuffle(order)
    pii_plan = [k for k in PII_SAMPLES for _ in range(pii_each)]
    pii_at = dict(zip(r.sample(range(n), len(pii_plan)), pii_plan))
    log = SynthLog(path, counts, pii={k: [] for k in PII_SAMPLES})
    lines: list[str] = []
    ok: list[dict] = []
    conv, turn = 0, conv_turns
    for i, task in enumerate(order):
        if turn >= r.randint(1, conv_turns):
            conv, turn = conv + 1, 0
        turn += 1
        user = " ".join(r.choice(vocab) for _ in range(r.randint(*words)))
        if i in pii_at:
            value = PII_SAMPLES[pii_at[i]](r)
            log.pii[pii_at[i]].append(value)
            user += f" contact {value} today"
        reply = " ".join(r.choice(vocab) for _ in range(r.randint(5, 20)))
        rec = {"id": f"chatcmpl-{i}", "created": 1.7e9 + i, "endpoint": "/v1/chat/completions", "model": "m",
               "status": "ok", "request": {"messages": [{"role": "user", "content": user}], "max_tokens": 32,
                                           "metadata": {"task": task, "conversation_id": f"{task}-c{conv}"}},
               "output": {"text": reply, "finish_reason": "stop"},
               "usage": {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0},
               "timings": {"queue_s": 0.0, "ttft_s": 0.1, "total_s": 0.5},
               "metadata": {"task": task, "conversation_id": f"{task}-c{conv}"}}
        ok.append(rec)
        lines.append(json.dumps(rec))
    pii_rows = set(pii_at)
    plain = [k for k in range(n) if k not in pii_rows]
    for j, k in enumerate(r.sample(plain, exact_dups)):
        lines.append(json.dumps({**ok[k], "id": f"dup-{j}"}))
    for j, k in enumerate(r.sample(plain, near_dups)):
        rec = json.loads(json.dumps(ok[k]))
        msg = rec["request"]["messages"][0]
        msg["content"] = msg["content"].replace(" ", "  ", 3) + f" {r.randrange(10, 99)}"
        rec["id"] = f"near-{j}"
        lines.append(json.dumps(rec))
    for j in range(failed):
        status = ("error", "rejected", "timeout")[j % 3]
        lines.append(json.dumps({"id": f"fail-{j}", "created": 1.8e9, "endpoint": "/v1/chat/completions",
                                 "model": "m", "status": status, "request": None if status == "rejected" else
                                 {"messages": [{"role": "user", "content": "x " * 40}]},
                                 "output": {"text": "", "finish_reason": None}, "metadata": {"task": "qa"}}))
    for j in range(short):
        lines.append(json.dumps({"id": f"short-{j}", "created": 1.8e9, "endpoint": "/v1/completions", "model": "m",
                                 "status": "ok", "request": {"prompt": f"w{j}"}, "output": {"text": "x"},
                                 "metadata": {"task": "qa"}}))
    for j in range(malformed):
        lines.append('{"id": "broken-%d", "status": "ok", "request": {' % j)
    r.shuffle(lines)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    log.planted = {"exact_duplicate": exact_dups, "near_duplicate": near_dups, "malformed_line": malformed,
                   "status_error": failed // 3, "status_rejected": failed // 3, "status_timeout": failed // 3,
                   "too_short": short}
    return log
