"""Server configuration: one dataclass the CLI fills and the app reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantpipe.runtime.server.request_log import RequestLogConfig


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # defaults to the model file/folder name
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    protect_metrics: bool = False  # also require a key on /metrics and /health
    request_timeout: float | None = 600.0  # seconds from arrival to last token; None: no limit
    drain_timeout: float = 30.0  # SIGTERM: seconds to let in-flight requests finish
    max_queued_requests: int | None = None  # admitted but not yet scheduled; None: unbounded
    max_queued_tokens: int | None = None  # their prompt + max_tokens
    rate_limit_rps: float | None = None  # per key (or client address without auth)
    rate_limit_tpm: float | None = None  # prompt + max_tokens per minute, per key
    max_body_bytes: int = 1 << 20
    log_level: str = "info"
    request_log: RequestLogConfig | None = None  # None: no production request log

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        for name in ("rate_limit_rps", "rate_limit_tpm", "request_timeout"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
