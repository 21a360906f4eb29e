"""Where a step's forward pass lies inside the step's time (issue 36, fid9): for the slo cut.

A real step runs, in order (timeline/tracer.py's phases): `schedule` and the runner's
`prepare` (before the forward), the `forward` (the decoder layers; the cut's layer hook runs
before each), then `sample` (the logits of the rows that sample, and sampling), `update` and
`output`, and the engine loop's gap to the next step. The runner's layer boundaries therefore
span the forward alone: boundary k falls at pre + k / L * forward from the step's start, not at
k / L of the whole step. On fid7's 16 kept slo runs a step with a prefill chunk spent 0.37 ms
(median) before its forward and 14.3 ms after it (sample ~9.4 ms + ~0.75 ms per sampled row,
then update, output, gap): for a 1.8-s chunk, boundary 26 of 30 ~12 ms earlier than evenly
spread over the step.

The profile key "forward_phases" (calibrate_trace: `fit_forward_phases`, from the traces'
phases) holds {"pre_s", "sample_const_s", "sample_per_row_s", "post_s", "num_steps"}:
- pre_s: median schedule + prepare;
- sample_const_s, sample_per_row_s: least squares of `sample` on the sampled rows over
  decode-only steps (every row samples; a prefill row samples only when its chunk ends the
  prompt, which one record does not say);
- post_s: median update + output + the gap to the next step (capped as the overhead fit's).
"""

from __future__ import annotations

import statistics
from typing import Mapping, Optional, Sequence

GAP_CAP_S = 0.002  # as calibrate_trace's: a longer gap is the process descheduled
KEYS = ("pre_s", "sample_const_s", "sample_per_row_s", "post_s")


def fit_forward_phases(traces: Sequence) -> Optional[dict]:
    """The "forward_phases" entry fitted to `traces` (timeline Trace objects), or None when
    they carry no phase times (no step with a forward phase, or no decode-only step)."""
    pre, post, rows, sample = [], [], [], []
    for trace in traces:
        steps = trace.steps
        for k, s in enumerate(steps):
            ph = s.get("phases")
            if not ph or "forward" not in ph or s.get("cut") or not s["reqs"]:
                continue
            pre.append(ph.get("schedule", 0.0) + ph.get("prepare", 0.0))
            gap = (steps[k + 1]["start"] - s["start"] - s["duration"]
                   if k + 1 < len(steps) else 0.0)
            post.append(ph.get("update", 0.0) + ph.get("output", 0.0)
                        + min(max(gap, 0.0), GAP_CAP_S))
            if all(r["prefill"] == 0 for r in s["reqs"]) and "sample" in ph:
                rows.append(len(s["reqs"]))
                sample.append(ph["sample"])
    if not pre or len(set(rows)) < 2:
        return None
    const, per_row = _line(rows, sample)
    return {"pre_s": statistics.median(pre), "sample_const_s": const,
            "sample_per_row_s": per_row, "post_s": statistics.median(post),
            "num_steps": len(pre)}


def _line(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """Ordinary least squares y = c + m * x, both clamped at >= 0."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    m = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
    return max(0.0, my - m * mx), m


class ForwardPhases:
    """A step of `seconds` split into (before the forward, the forward, after it)."""

    def __init__(self, phases: Mapping[str, float]) -> None:
        self.pre, self.post = float(phases["pre_s"]), float(phases["post_s"])
        self.sample_const = float(phases["sample_const_s"])
        self.sample_per_row = float(phases["sample_per_row_s"])

    @classmethod
    def of(cls, latency_model) -> Optional["ForwardPhases"]:
        """The latency model's phases (a fitted profile's "forward_phases"), else None."""
        phases = getattr(latency_model, "forward_phases", None)
        return cls(phases) if phases else None

    def split(self, seconds: float, sampled_rows: int) -> tuple[float, float, float]:
        """(pre, forward, post) of a step of `seconds` whose `sampled_rows` rows sample;
        a step too short to hold the phases is all forward (0, seconds, 0)."""
        post = self.post + (self.sample_const + self.sample_per_row * sampled_rows
                            if sampled_rows else 0.0)
        forward = seconds - self.pre - post
        if forward <= 0:
            return 0.0, seconds, 0.0
        return self.pre, forward, post

    def cut_seconds(self, split: tuple[float, float, float], layer: int,
                    num_layers: int) -> float:
        """A step (`split` as `split` returned it) cut before `layer`: its pre-forward work,
        `layer` layers, then the engine's update and output (a cut step samples nothing)."""
        pre, forward, post = split
        return pre + forward * layer / num_layers + min(post, self.post)
