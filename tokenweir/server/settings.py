"""The HTTP server's own settings (the engine has EngineConfig).

Every field's `help` metadata is CLI help, as in tokenweir/config.py: a flag generator over
config dataclasses turns a field into `--field-name`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tokenweir.config import DEFAULT_MAX_REQUEST_BODY_BYTES


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...] = _f(
        (), "name(s) clients use for the model (default: the model argument)")
    api_key: Optional[str] = _f(
        None, "require `Authorization: Bearer KEY` on /v1/* (default: $TOKENWEIR_API_KEY)")
    max_waiting_requests: Optional[int] = _f(
        None, "answer 503 + Retry-After while this many requests wait (default: unbounded)")
    drain_timeout: float = _f(
        30.0, "seconds to let running requests finish on SIGTERM/SIGINT; then each is ended "
              "with finish_reason 'abort'")
    max_request_body_bytes: int = _f(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        "largest request body accepted, in bytes; a larger one is answered 413 before it is "
        "read in full")

    slo_reject_hopeless: bool = _f(
        False, "with a deadline-aware scheduling policy (slo), answer 503 + Retry-After to a "
        "request whose ttft_slo_ms its TTFT predictor says it cannot meet even alone")
    timeline_steps: int = _f(
        2000, "the most recent steps GET /timeline shows; 0 turns it off")

    def __post_init__(self) -> None:
        if self.max_request_body_bytes <= 0:
            raise ValueError("max_request_body_bytes must be positive, "
                             f"got {self.max_request_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
