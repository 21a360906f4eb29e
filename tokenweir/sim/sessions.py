"""Agentic sessions: multi-turn conversations whose next turn arrives a tool-call delay after the
previous turn finished.

A session is planned up front from its seed (turn count, lengths, delays), so a run stays a pure
function of its inputs whatever order events happen in. Turn k's prompt is turn k-1's prompt,
plus turn k-1's output exactly as the simulator produced it, plus `user_len` new tokens unique to
(session, turn): a later turn's leading blocks are the earlier turn's, which is what prefix
caching (and a prefix-aware router) can reuse. Turns that would overflow `max_model_len` are
dropped from the plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from tokenweir.sim.workload import arrival_times, parse_length_dist, sample_length

_SESSION_TOKEN_BASE = 40_000_000
_TURN_TOKEN_BASE = 50_000_000
_FILLER_TOKEN = 7
_MAX_TURNS = 1000


@dataclass(slots=True)
class Turn:
    user_len: int  # new tokens (the first turn: the whole prompt)
    output_len: int
    delay: float  # seconds after the previous turn finished (first turn: 0)


@dataclass(slots=True)
class Session:
    session_id: int
    start: float  # the first turn's arrival
    turns: list[Turn] = field(default_factory=list)
    priority: int = 0

    def request_id(self, turn: int) -> str:
        return f"s{self.session_id}.t{turn}"

    def first_prompt(self) -> list[int]:
        return [_SESSION_TOKEN_BASE + self.session_id] + \
            [_FILLER_TOKEN] * (self.turns[0].user_len - 1)

    def next_prompt(self, turn: int, previous_tokens: list[int]) -> list[int]:
        """Turn `turn`'s prompt: everything turn - 1 saw and said, then the new user tokens."""
        unique = _TURN_TOKEN_BASE + self.session_id * _MAX_TURNS + turn
        return list(previous_tokens) + [unique] + \
            [_FILLER_TOKEN] * (self.turns[turn].user_len - 1)


def synthetic_sessions(num_sessions: int, rate: float, seed: int = 0,
                       prompt: str = "fixed:512", output: str = "fixed:128",
                       turns: str = "fixed:4", user_len: str = "fixed:64",
                       tool_delay_ms: str = "fixed:500", arrival: str = "poisson",
                       cv: float = 1.0, max_model_len: Optional[int] = None) -> list[Session]:
    """Seeded sessions starting at `rate` per second. `tool_delay_ms` is a length distribution
    read in milliseconds (fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA)."""
    rng = random.Random(seed)
    dists = {name: parse_length_dist(spec) for name, spec in (
        ("prompt", prompt), ("output", output), ("turns", turns), ("user", user_len),
        ("delay", tool_delay_ms))}
    cap = max_model_len or 1 << 30
    sessions = []
    for sid, start in enumerate(arrival_times(rng, num_sessions, rate, arrival, cv)):
        session = Session(sid, start)
        num_turns = sample_length(rng, dists["turns"], _MAX_TURNS)
        context = 0
        for k in range(num_turns):
            new = sample_length(rng, dists["prompt" if k == 0 else "user"], cap)
            out = sample_length(rng, dists["output"], cap)
            delay = 0.0 if k == 0 else sample_length(rng, dists["delay"], 1 << 30) / 1000
            if context + new + out > cap:
                break
            session.turns.append(Turn(new, out, delay))
            context += new + out
        if session.turns:
            sessions.append(session)
    return sessions
