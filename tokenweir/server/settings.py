"""The HTTP server's own settings (the engine has EngineConfig), derived from
`config.ServeConfig`, which the `tokenweir serve` flags are generated from: the fields the
server reads are ServeConfig's fields of the same names (default and help taken from there,
never written twice). Only `served_model_names` is the server's own: the names resolved at
start-up (the flag's, else the model argument; the engine's model name always among them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenweir.config import ServeConfig

_SERVE_FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}
# ServeConfig's fields that the running server reads, under their ServeConfig names.
SHARED_FIELDS = ("api_key", "max_waiting_requests", "drain_timeout", "max_request_body_bytes",
                 "timeline_steps", "slo_reject_hopeless")


def _from_serve_config(name: str) -> Any:
    """A field with ServeConfig's default and metadata for `name`."""
    source = _SERVE_FIELDS[name]
    return field(default=source.default, metadata=source.metadata)


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...] = field(
        default=(), metadata={"help": "name(s) clients use for the model (resolved at start)"})
    api_key: Optional[str] = _from_serve_config("api_key")
    max_waiting_requests: Optional[int] = _from_serve_config("max_waiting_requests")
    drain_timeout: float = _from_serve_config("drain_timeout")
    max_request_body_bytes: int = _from_serve_config("max_request_body_bytes")
    timeline_steps: int = _from_serve_config("timeline_steps")
    slo_reject_hopeless: bool = _from_serve_config("slo_reject_hopeless")

    def __post_init__(self) -> None:
        if self.max_request_body_bytes <= 0:
            raise ValueError("max_request_body_bytes must be positive, "
                             f"got {self.max_request_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")

    @classmethod
    def from_serve_args(cls, args: argparse.Namespace,
                        served_model_names: tuple[str, ...]) -> "ServerSettings":
        """The settings of a parsed `tokenweir serve` command line: every shared field as
        given; the API key falls back to $TOKENWEIR_API_KEY (an empty one means none)."""
        shared = {name: getattr(args, name) for name in SHARED_FIELDS}
        shared["api_key"] = args.api_key or os.environ.get("TOKENWEIR_API_KEY") or None
        return cls(served_model_names=served_model_names, **shared)
