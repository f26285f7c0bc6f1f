"""The per-request result format, shared by the load generator and (later) the simulator.

All times are seconds on one monotonic clock, measured from the start of the run.
Latencies are derived, never stored, so a record can't contradict itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class RequestRecord:
    index: int
    stage: str = ""
    intended_send: float = 0.0  # when the schedule wanted it sent
    actual_send: float = 0.0  # when the client actually started sending it
    first_token: float | None = None  # first chunk carrying output text
    chunk_times: list[float] = field(default_factory=list)  # every output-carrying chunk
    end: float | None = None  # last byte received (or failure)
    prompt_tokens: int = 0
    output_tokens: int = 0
    planned_prompt_tokens: int = 0
    planned_output_tokens: int = 0
    prompt_tokens_source: str = ""  # usage | tokenizer:<src> | planned
    output_tokens_source: str = ""  # usage | tokenizer:<src> | chunks
    status: int = 0  # HTTP status, 0 when no response arrived
    error: str = ""
    timed_out: bool = False
    session: int = -1
    turn: int = 0
    prefix_group: int = -1

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and not self.timed_out and self.end is not None

    # ---- derived latencies (None when not applicable) ------------------------------
    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.actual_send

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.actual_send

    @property
    def ttft_intended(self) -> float | None:
        """TTFT counted from the intended send time: includes client-side schedule lag,
        which is what a user arriving on schedule would have felt (coordinated omission)."""
        return None if self.first_token is None else self.first_token - self.intended_send

    @property
    def e2e_intended(self) -> float | None:
        return None if self.end is None else self.end - self.intended_send

    @property
    def schedule_lag(self) -> float:
        return self.actual_send - self.intended_send

    @property
    def tpot(self) -> float | None:
        """vLLM bench definition: (E2E - TTFT) / (output_tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        c = self.chunk_times
        return [b - a for a, b in zip(c, c[1:])]

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("intended_send", "actual_send", "first_token", "end"):
            if d[k] is not None:
                d[k] = round(d[k], 6)
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


CSV_COLUMNS = [
    "stage", "index", "intended_send", "actual_send", "first_token", "end", "ttft", "tpot", "e2e",
    "ttft_intended", "e2e_intended", "schedule_lag", "prompt_tokens", "output_tokens",
    "prompt_tokens_source", "output_tokens_source", "status", "error", "timed_out", "session", "turn",
    "prefix_group",
]


def csv_row(r: RequestRecord) -> list:
    return [getattr(r, c) for c in CSV_COLUMNS]
