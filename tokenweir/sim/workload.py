"""Seeded workloads: arrival processes, length distributions, prefix groups, priority classes,
and JSONL traces.

A workload is a list of `RequestSpec`, sorted by (arrival, index). Prompt token ids are built
lazily (`prompt_tokens`) when a request arrives, so 100k-request workloads stay small. Ids are
synthetic and may exceed any vocabulary: only their equality matters (prefix caching). Requests
in one prefix group share their first `prefix_len` tokens; everything after is unique to the
request, so no two requests share a block by accident.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Optional

_GROUP_TOKEN_BASE = 1_000_000
_UNIQUE_TOKEN_BASE = 10_000_000
_FILLER_TOKEN = 7


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    arrival: float  # seconds on the virtual clock
    prompt_len: int
    output_len: int  # EOS is sampled as the output's output_len-th token
    priority: int = 0
    ttft_slo_ms: Optional[float] = None  # per-request TTFT deadline (goodput); None: global
    prefix_group: Optional[int] = None
    prefix_len: int = 0  # leading tokens shared with the group (0 without a group)
    index: int = 0  # position in the workload: makes each prompt unique

    def prompt_tokens(self) -> list[int]:
        shared = min(self.prefix_len, self.prompt_len - 1) if self.prefix_group is not None else 0
        head = [_GROUP_TOKEN_BASE + self.prefix_group] * shared if shared else []
        return head + [_UNIQUE_TOKEN_BASE + self.index] + \
            [_FILLER_TOKEN] * (self.prompt_len - shared - 1)


# ---- distributions ---------------------------------------------------------------------
def parse_length_dist(spec: str) -> tuple[str, list[float]]:
    """'fixed:N', 'uniform:LO:HI', or 'lognormal:MEDIAN:SIGMA'."""
    name, *args = spec.split(":")
    expected = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if name not in expected or len(args) != expected[name]:
        raise ValueError(f"bad length distribution {spec!r}: use fixed:N, uniform:LO:HI or "
                         f"lognormal:MEDIAN:SIGMA")
    try:
        values = [float(a) for a in args]
    except ValueError:
        raise ValueError(f"bad length distribution {spec!r}: arguments must be numbers") from None
    if name == "uniform" and not 1 <= values[0] <= values[1]:
        raise ValueError(f"bad length distribution {spec!r}: need 1 <= LO <= HI")
    if name != "uniform" and values[0] < 1:
        raise ValueError(f"bad length distribution {spec!r}: length must be >= 1")
    return name, values


def sample_length(rng: random.Random, dist: tuple[str, list[float]], cap: int) -> int:
    name, args = dist
    if name == "fixed":
        value = args[0]
    elif name == "uniform":
        value = rng.randint(int(args[0]), int(args[1]))
    else:
        value = rng.lognormvariate(math.log(args[0]), args[1])
    return max(1, min(cap, int(round(value))))


def arrival_times(rng: random.Random, n: int, rate: float, process: str = "poisson",
                  cv: float = 1.0) -> list[float]:
    """Arrival times of n requests at `rate` per second (inf: all at t=0). `gamma` takes the
    coefficient of variation of inter-arrival gaps (cv=1 is Poisson; >1 burstier)."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    if process == "poisson":
        gaps = (rng.expovariate(rate) for _ in range(n))
    elif process == "gamma":
        if cv <= 0:
            raise ValueError(f"gamma cv must be positive, got {cv}")
        shape = 1.0 / (cv * cv)
        gaps = (rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n))
    else:
        raise ValueError(f"unknown arrival process {process!r}: poisson or gamma")
    times, t = [], 0.0
    for gap in gaps:
        t += gap
        times.append(t)
    return times


def parse_priority_mix(spec: Optional[str]) -> list[tuple[int, float]]:
    """'0:0.8,1:0.2' -> [(0, 0.8), (1, 0.2)] (priority: weight)."""
    if not spec:
        return [(0, 1.0)]
    mix = []
    for part in spec.split(","):
        try:
            prio, weight = part.split(":")
            mix.append((int(prio), float(weight)))
        except ValueError:
            raise ValueError(f"bad priority mix {spec!r}: use PRIO:WEIGHT,...") from None
    return mix


def synthetic(num_requests: int, rate: float, seed: int = 0, prompt: str = "fixed:128",
              output: str = "fixed:128", arrival: str = "poisson", cv: float = 1.0,
              num_prefix_groups: int = 0, prefix_len: int = 0,
              priority_mix: Optional[str] = None, max_model_len: Optional[int] = None,
              ttft_slo_ms: Optional[float] = None) -> list[RequestSpec]:
    """A seeded synthetic workload. Lengths are capped so prompt + output <= max_model_len."""
    rng = random.Random(seed)
    prompt_dist, output_dist = parse_length_dist(prompt), parse_length_dist(output)
    mix = parse_priority_mix(priority_mix)
    prios, weights = [p for p, _ in mix], [w for _, w in mix]
    cap = max_model_len or 1 << 30
    times = arrival_times(rng, num_requests, rate, arrival, cv)
    specs = []
    for i, t in enumerate(times):
        p = sample_length(rng, prompt_dist, cap - 1)
        o = sample_length(rng, output_dist, cap - p)
        group = rng.randrange(num_prefix_groups) if num_prefix_groups else None
        prio = prios[0] if len(prios) == 1 else rng.choices(prios, weights)[0]
        specs.append(RequestSpec(f"r{i}", t, p, o, prio, ttft_slo_ms, group,
                                 prefix_len if group is not None else 0, i))
    return specs


# ---- traces ------------------------------------------------------------------------------
_REQUIRED = {"arrival": (int, float), "prompt_len": int, "output_len": int}
_OPTIONAL = {"priority": int, "ttft_slo_ms": (int, float), "prefix_group": int,
             "prefix_len": int, "request_id": str}


class TraceError(ValueError):
    pass


def _parse_line(text: str, where: str, index: int) -> RequestSpec:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name, kind in _REQUIRED.items():
        if name not in obj:
            raise TraceError(f"{where}: missing required field {name!r}")
    for name, kind in {**_REQUIRED, **_OPTIONAL}.items():
        value = obj.get(name)
        if value is None and name in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TraceError(f"{where}: field {name!r} has bad type {type(value).__name__}")
    if obj["arrival"] < 0 or not math.isfinite(obj["arrival"]):
        raise TraceError(f"{where}: arrival must be a finite number >= 0, got {obj['arrival']}")
    for name in ("prompt_len", "output_len"):
        if obj[name] < 1:
            raise TraceError(f"{where}: {name} must be >= 1, got {obj[name]}")
    group = obj.get("prefix_group")
    return RequestSpec(obj.get("request_id") or f"r{index}", float(obj["arrival"]),
                       obj["prompt_len"], obj["output_len"], obj.get("priority") or 0,
                       obj.get("ttft_slo_ms"), group,
                       obj.get("prefix_len", 0) if group is not None else 0, index)


def load_trace(path: str, default_prefix_len: int = 0) -> list[RequestSpec]:
    """Read a JSONL trace; a bad line raises TraceError naming the file and line number.
    Blank lines are skipped. `default_prefix_len` applies to grouped lines without one."""
    specs: list[RequestSpec] = []
    ids: set[str] = set()
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            spec = _parse_line(text, f"{path}:{lineno}", len(specs))
            if spec.prefix_group is not None and not spec.prefix_len:
                spec.prefix_len = default_prefix_len
            if spec.request_id in ids:
                raise TraceError(f"{path}:{lineno}: duplicate request_id {spec.request_id!r}")
            ids.add(spec.request_id)
            specs.append(spec)
    specs.sort(key=lambda s: (s.arrival, s.index))
    return specs


def save_trace(specs: list[RequestSpec], path: str) -> None:
    with open(path, "w") as f:
        for s in sorted(specs, key=lambda s: s.index):
            row = {k: v for k, v in asdict(s).items() if k != "index"}
            if s.prefix_group is None:
                del row["prefix_group"], row["prefix_len"]
            if s.ttft_slo_ms is None:
                del row["ttft_slo_ms"]
            f.write(json.dumps(row) + "\n")
