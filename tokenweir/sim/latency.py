"""Latency models: how long one step takes on the virtual clock.

Interface (`LatencyModel`): `predict(scheduler_output, context_lens) -> seconds`, where
`context_lens[req_id]` is the number of tokens whose KV the request already has in the cache
before this step (its `num_computed_tokens` as the runner tracks it). Every request in
`scheduler_output.num_scheduled_tokens` must have an entry. Models are pure functions of their
arguments: the simulator's determinism rests on it.

Every model here depends on a step only through a few sums over its requests (`StepTotals`),
so each also offers `predict_totals(totals)`; the SimRunner accumulates the sums while it
advances the requests and calls that instead (one pass over the batch, not two). Both give
the same float for the same step.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Protocol

from tokenweir.core.outputs import SchedulerOutput
from tokenweir.sim.hardware import HardwareProfile, ModelShape


class LatencyModel(Protocol):
    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float: ...


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Sums over one step's requests, each computing q new tokens on c cached ones."""

    num_tokens: int = 0  # sum q
    num_reqs: int = 0
    num_decode_reqs: int = 0  # requests with q == 1
    sum_context: int = 0  # sum c
    sum_q_context: int = 0  # sum q * c
    sum_q_squared: int = 0  # sum q * q
    decode_context: int = 0  # sum c over the requests with q == 1

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the requests computing more than one token this step."""
        return self.num_tokens - self.num_decode_reqs

    @classmethod
    def of_chunks(cls, chunks: Iterable[tuple[int, int]]) -> "StepTotals":
        """From `(num_new_tokens, num_cached_tokens)` per request."""
        t = r = d = sc = sqc = sqq = dc = 0
        for q, c in chunks:
            t += q
            r += 1
            sc += c
            sqc += q * c
            sqq += q * q
            if q == 1:
                d += 1
                dc += c
        return cls(t, r, d, sc, sqc, sqq, dc)

    @classmethod
    def of_step(cls, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> "StepTotals":
        return cls.of_chunks((q, context_lens[rid]) for rid, q in
                             scheduler_output.num_scheduled_tokens.items())


class RooflineLatencyModel:
    """Analytic roofline of one forward step, split tensor-parallel over `tp` devices.

    step = overhead
         + max(linear FLOPs / FLOP/s, weight bytes / bandwidth)          (GEMMs and LM head)
         + max(attention FLOPs / FLOP/s, KV bytes read+written / bandwidth)
         + 2 ring all-reduces per layer of the step's activations (tp > 1 only).
    Attention FLOPs are causal: a chunk of q new tokens on c cached ones costs
    4 * heads * head_dim * q * (c + (q + 1) / 2) per layer. The LM head runs once per scheduled
    request (logits only at each request's last position). KV bytes follow the KV heads (GQA).

    Mixture of experts (`shape.num_experts` > 0): each token's linear FLOPs are its ACTIVE
    weights (attention, router, shared expert, `num_experts_per_tok` experts); the weight bytes
    a step of B tokens reads are the always-read weights plus, per MoE layer, the distinct
    experts its tokens touch: E * (1 - (1 - k/E) ** B) in expectation under balanced routing
    (`ModelShape.expected_experts_touched`; at most min(E, B * k)).

    Sliding window (`shape.sliding_window` = W): `attention_window` tells the SimRunner to
    cap each request's cached context at W in the step's sums, so attention FLOPs and KV
    reads stop growing past W. Approximation: the causal term inside a chunk longer than W is
    not capped. The KV pool frees the blocks that slid out (core/sliding_window.py), as vLLM does.
    """

    def __init__(self, shape: ModelShape, hardware: HardwareProfile, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
        self.shape, self.hardware, self.tp = shape, hardware, tp
        dt = hardware.dtype_bytes
        flops = hardware.effective_flops * tp
        bw = hardware.effective_bandwidth * tp
        # Per-unit costs, precomputed: the hot path is a few multiply-adds per step.
        self._s_per_token_linear = 2 * shape.active_layer_params_per_token / flops
        self._s_per_lm_head_row = 2 * shape.vocab_size * shape.hidden_size / flops
        self._s_weights = shape.dense_matmul_params * dt / bw  # read whatever the routing
        # seconds to read one expert's weights in every MoE layer (0 for a dense shape)
        self._s_per_expert_touched = shape.num_moe_layers * shape.expert_params * dt / bw
        self.attention_window = shape.sliding_window  # read by the SimRunner
        # Attention: 4*H*hd*L * q*(c + (q+1)/2) = 2*H*hd*L * q*(2c + q + 1)
        self._s_per_attn_unit = 2 * shape.num_heads * shape.head_dim * shape.num_layers / flops
        self._s_per_kv_token = shape.kv_bytes_per_token(dt) / bw
        self._overhead = hardware.step_overhead_s
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            calls = 2 * shape.num_layers
            self._s_allreduce_per_token = (calls * ring * shape.hidden_size * dt
                                           / hardware.interconnect_bandwidth)
            self._s_allreduce_fixed = calls * hardware.allreduce_latency_s
        else:
            self._s_allreduce_per_token = self._s_allreduce_fixed = 0.0

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step computing `(num_new_tokens, num_cached_tokens)` per request."""
        return self.predict_totals(StepTotals.of_chunks(chunks))

    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float:
        return self.predict_totals(StepTotals.of_step(scheduler_output, context_lens))

    def predict_totals(self, t: StepTotals) -> float:
        # sum q*(2c + q + 1) attention units; read the context and the new tokens, write the
        # new ones: sum (c + 2q) KV tokens. Integer sums: exact whatever the order.
        attn_units = 2 * t.sum_q_context + t.sum_q_squared + t.num_tokens
        kv_tokens = t.sum_context + 2 * t.num_tokens
        return self._combine(t.num_tokens, t.num_reqs, attn_units, kv_tokens)

    def predict_decodes(self, n: int, context: int) -> float:
        """`predict_totals` of n requests computing one token each on `context` cached tokens
        in all (StepTotals(n, n, n, context, context, n, context)), the same operations
        without building it: a decode stretch's step (sim/decode_stretch.py)."""
        return self._combine(n, n, 2 * context + n + n, context + 2 * n)

    def _combine(self, tokens: int, rows: int, attn_units: int, kv_tokens: int) -> float:
        if tokens == 0:
            return 0.0
        weights = self._s_weights
        if self._s_per_expert_touched:
            weights += self._s_per_expert_touched * self.shape.expected_experts_touched(tokens)
        linear = max(tokens * self._s_per_token_linear + rows * self._s_per_lm_head_row,
                     weights)
        attention = max(attn_units * self._s_per_attn_unit, kv_tokens * self._s_per_kv_token)
        comm = tokens * self._s_allreduce_per_token + self._s_allreduce_fixed
        return self._overhead + linear + attention + comm


def decode_predictor(model) -> Optional[Callable[[int, int], float]]:
    """`model.predict_decodes` where it is exactly `model.predict_totals` of pure-decode totals
    (the roofline's own pair); None for any other model, a subclass that overrides either, and
    a wrapper that forwards attributes (NoisyLatencyModel must draw in predict_totals)."""
    cls = type(model)
    if getattr(cls, "predict_totals", None) is RooflineLatencyModel.predict_totals and \
            getattr(cls, "predict_decodes", None) is RooflineLatencyModel.predict_decodes:
        return model.predict_decodes
    return None


class ConstantLatencyModel:
    """Every non-empty step takes `seconds` (tests, and back-of-envelope runs)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float:
        return self.seconds if scheduler_output.total_num_scheduled_tokens else 0.0

    def predict_totals(self, totals: StepTotals) -> float:
        return self.seconds if totals.num_tokens else 0.0


class NoisyLatencyModel:
    """A model's step times times a seeded log-normal factor of mean 1 (`sigma` is the
    log-space standard deviation): a real machine's step-to-step jitter, for asking whether a
    policy's gain survives predictions that are right only on average.

    Only `predict_totals` draws; it is what the SimRunner times each step with, once per step,
    so a run stays deterministic for a given seed. `scale` multiplies every drawn step (a
    machine running slower or faster than the model all run long: `sample_machines`).
    `predict` and `step_time` return the noise-free, unscaled mean: what a scheduler
    forecasting a step, or a fit of solo TTFTs, sees. `drift` (a `drift.DriftProcess`)
    multiplies each drawn step by the machine's slow wander inside the run as well, its clock
    advanced by the drawn step; None (the default) draws exactly as without it.
    """

    def __init__(self, base, sigma: float, seed: int = 0, scale: float = 1.0,
                 drift=None) -> None:
        if sigma < 0 or scale <= 0:
            raise ValueError(f"need sigma >= 0 and scale > 0, got {sigma}, {scale}")
        self.base = base
        self.sigma = sigma
        self.scale = scale
        self.drift = drift  # a drift.DriftProcess (its own random stream), or None
        self._rng = random.Random(seed)
        self._mu = -sigma * sigma / 2  # E[exp(N(mu, sigma))] = 1

    def __getattr__(self, name):  # shape, kv_bytes_per_token, ... of the wrapped model
        return getattr(self.base, name)

    def predict_totals(self, totals: StepTotals) -> float:
        seconds = (self.base.predict_totals(totals) * self.scale
                   * math.exp(self._rng.gauss(self._mu, self.sigma)))
        if self.drift is None:
            return seconds
        seconds *= self.drift.factor()
        self.drift.advance(seconds)  # the drift's clock: the steps' own (busy) time
        return seconds

    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float:
        return self.base.predict(scheduler_output, context_lens)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.base.step_time(chunks)


# ---- fitted (tokenweir calibrate) -----------------------------------------------------------
FITTED_FEATURES = ("const", "prefill_tokens", "decode_rows", "prefill_attention",
                   "decode_context", "prefill_rows", "multi_decode", "prefill_self_attention",
                   "decode_context_hinge")


def fitted_features(t: StepTotals, hinge_tokens: int = 0) -> tuple[float, ...]:
    """The regressors of the fitted step-time model, in FITTED_FEATURES order:
    1; tokens of the requests computing more than one token ("prefills"); requests computing
    exactly one ("decodes": one token, one LM-head row, one sample each); the prefills' causal
    attention pairs sum q * (c + (q + 1) / 2); the decodes' context tokens read (sum c);
    prefill rows (one LM-head row each); 1 when two or more decodes share the step (batched
    decode attention has a fixed cost a lone decode does not pay); the prefills' pairs within
    their own chunks, sum q * (q + 1) / 2 (an extra cost per pair over the cached-context
    pairs: on CPU the two run on different kernels, and a fit to real traces found a pair
    within the chunk ~2x the cost of one over the context). Prefill and decode attention are
    apart because their kernels differ by an order of magnitude per pair. A profile fitted
    before a feature existed has no coefficient for it (0): its predictions do not change.

    Last, the hinge (issue 36, fid7): the decodes' context tokens beyond `hinge_tokens`
    (max(0, decode_context - hinge_tokens); 0 with hinge_tokens 0, the knee unset): decode
    attention costs more per token once a step's KV no longer stays near the core (fid6: decode
    steps of >= 3 rows at >= 300 context tokens each ran 1.05-1.12x a linear profile in every
    workload). The knee is the profile's ("decode_hinge_tokens"), chosen by held-out error
    (calibrate_trace.choose_hinge)."""
    num_prefill_rows = t.num_reqs - t.num_decode_reqs
    self_attention = (t.sum_q_squared - t.num_decode_reqs + t.num_prefill_tokens) / 2
    prefill_attention = (t.sum_q_context - t.decode_context) + self_attention
    beyond = t.decode_context - hinge_tokens if hinge_tokens else 0
    return (1.0, float(t.num_prefill_tokens), float(t.num_decode_reqs), prefill_attention,
            float(t.decode_context), float(num_prefill_rows),
            1.0 if t.num_decode_reqs >= 2 else 0.0, self_attention, float(max(beyond, 0)))


# The engine's own per-step work around the runner (schedule, update, output processing,
# the loop): a constant, per scheduled request, per decode request (one sampled token to
# append, stop-check, detokenize). Fitted from real-engine traces (`--from-trace`).
OVERHEAD_FEATURES = ("const", "requests", "decode_requests")


# Steps of few rows (decode batches): every matmul of the step runs on x of num_tokens rows,
# and the CPU kernels pick their code by that count (the direct path binds one op per count up
# to 16; the float32 packed kernel keeps 6 rows per pass, so 7 rows take a second one): the
# time is a staircase in the count that no linear term follows (issue 16, SmolLM2 float32 on
# one thread: 6 decode rows 0.9 ms below the linear fit, 7 rows 2.4 ms above). A fitted
# profile may carry a table {num_tokens: seconds} for counts up to FEW_ROWS_MAX, added to the
# runner time of a step of that many tokens (`calibrate --from-trace` fits it from the linear
# model's residuals per count: calibrate_trace.fit_few_rows; counts it saw too rarely are
# absent, i.e. 0).
FEW_ROWS_MAX = 16


def few_rows_table(table: Optional[Mapping]) -> dict[int, float]:
    """{num_tokens: seconds} from a profile's "few_rows" (JSON keys are strings)."""
    out = {int(k): float(v) for k, v in (table or {}).items()}
    bad = [k for k in out if not 1 <= k <= FEW_ROWS_MAX]
    if bad:
        raise ValueError(f"few_rows counts {sorted(bad)} outside 1..{FEW_ROWS_MAX}")
    return out


# A step is "decode" when every request in it computes one token (memory-bound: it reads every
# weight for a few rows), else "prefill" (a chunk in it: compute-bound). A machine's speed
# drifts differently for the two (calibrate_trace.machine_speed measures it per kind), and a
# fitted profile may scale each kind's runner time ("runner_scale").
STEP_KINDS = ("decode", "prefill")


def step_kind(totals: StepTotals) -> str:
    """"decode" when every request computes one token, else "prefill" (a chunk in it)."""
    return "decode" if totals.num_decode_reqs == totals.num_reqs else "prefill"


def runner_scale_factors(scale: Optional[Mapping]) -> Optional[tuple[float, float]]:
    """(decode, prefill) factors from a profile's "runner_scale" ({kind: factor}, a kind
    absent: 1); None when there is none or every factor is 1."""
    scale = dict(scale or {})
    unknown = set(scale) - set(STEP_KINDS)
    if unknown:
        raise ValueError(f"runner_scale kinds {sorted(unknown)}; known: {list(STEP_KINDS)}")
    factors = tuple(float(scale.get(k, 1.0)) for k in STEP_KINDS)
    if any(not f > 0 for f in factors):
        raise ValueError(f"runner_scale factors must be > 0, got {scale}")
    return None if factors == (1.0, 1.0) else factors


def overhead_features(t: StepTotals) -> tuple[float, ...]:
    """The regressors of the engine overhead, in OVERHEAD_FEATURES order."""
    return (1.0, float(t.num_reqs), float(t.num_decode_reqs))


class FittedLatencyModel:
    """Step time = runner time + engine overhead. Runner time: sum of coefficient x feature
    (see `fitted_features`), fitted by least squares to a real runner's timings (`tokenweir
    calibrate`, which writes the profile JSON that `from_profile` reads; its format is
    documented in sim/calibrate.py), plus `few_rows[num_tokens]` for a step of few rows
    (FEW_ROWS_MAX; profiles fitted from traces; absent: 0). Engine overhead: sum of
    `overhead` coefficient x `overhead_features` (all 0 unless the profile was fitted from
    real-engine traces; a profile without them loads as before and predicts the same floats).

    `runner_scale` ({"decode": d, "prefill": p}, profile key "runner_scale"; absent: 1)
    multiplies the runner time of each kind of step (`step_kind`): the machine slower (> 1) or
    faster than the one calibrated, e.g. as a real run measured it (calibrate_trace.
    machine_speed). The engine overhead is not scaled.

    Also carries what the simulator needs to size the KV pool as the real engine would:
    `kv_bytes_per_token`, `block_size` and `max_model_len` of the calibrated model, and its
    `num_layers` (where a mid-step cut can fall; 0: unknown, profiles written before it).

    `decode_hinge_tokens` (profile key of that name; absent or 0: no hinge) is the knee of
    the "decode_context_hinge" feature (`fitted_features`).
    """

    def __init__(self, coefficients: Mapping[str, float], kv_bytes_per_token: int = 0,
                 max_model_len: int = 0, block_size: int = 16, name: str = "fitted",
                 overhead: Optional[Mapping[str, float]] = None, num_layers: int = 0,
                 few_rows: Optional[Mapping] = None,
                 runner_scale: Optional[Mapping[str, float]] = None,
                 decode_hinge_tokens: int = 0) -> None:
        unknown = set(coefficients) - set(FITTED_FEATURES)
        if unknown:
            raise ValueError(f"unknown fitted-model coefficients {sorted(unknown)}; "
                             f"known: {list(FITTED_FEATURES)}")
        unknown = set(overhead or {}) - set(OVERHEAD_FEATURES)
        if unknown:
            raise ValueError(f"unknown engine-overhead coefficients {sorted(unknown)}; "
                             f"known: {list(OVERHEAD_FEATURES)}")
        self.coefficients = {f: float(coefficients.get(f, 0.0)) for f in FITTED_FEATURES}
        self._weights = tuple(self.coefficients[f] for f in FITTED_FEATURES)
        self.overhead = {f: float((overhead or {}).get(f, 0.0)) for f in OVERHEAD_FEATURES}
        self._overhead_weights = (tuple(self.overhead[f] for f in OVERHEAD_FEATURES)
                                  if any(self.overhead.values()) else None)
        self.few_rows = few_rows_table(few_rows)
        # where the forward lies in a step (sim/forward_phases.py; None: unknown)
        self.forward_phases: Optional[dict] = None
        self._runner_scale = runner_scale_factors(runner_scale)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.name = name
        self.num_layers = num_layers
        if decode_hinge_tokens < 0:
            raise ValueError(f"decode_hinge_tokens must be >= 0, got {decode_hinge_tokens}")
        self.decode_hinge_tokens = int(decode_hinge_tokens)

    @classmethod
    def from_profile(cls, profile: "str | Mapping") -> "FittedLatencyModel":
        """From a profile JSON path, or the already-loaded dict."""
        if isinstance(profile, str):
            import json
            with open(profile) as f:
                data = json.load(f)
            where = profile
        else:
            data, where = profile, "profile"
        try:
            coefficients = data["coefficients"]
        except (KeyError, TypeError):
            raise ValueError(f"{where}: not a tokenweir calibrate profile (no 'coefficients'; "
                             f"run `tokenweir calibrate MODEL --out PATH`)") from None
        model = cls(coefficients, int(data.get("kv_bytes_per_token", 0)),
                    int(data.get("max_model_len", 0)), int(data.get("block_size", 16)),
                    str(data.get("model", "fitted")), data.get("overhead"),
                    int(data.get("num_layers") or 0), data.get("few_rows"),
                    data.get("runner_scale"), int(data.get("decode_hinge_tokens") or 0))
        model.forward_phases = data.get("forward_phases")
        return model

    @property
    def runner_scale(self) -> dict[str, float]:
        """The runner-time factor per step kind (1 for both when the profile has none)."""
        return dict(zip(STEP_KINDS, self._runner_scale or (1.0, 1.0)))

    def predict_totals(self, totals: StepTotals) -> float:
        if not totals.num_tokens:
            return 0.0
        seconds = self.runner_seconds(totals)
        if self._overhead_weights is not None:
            seconds += self.overhead_seconds(totals)
        return seconds

    def runner_seconds(self, totals: StepTotals) -> float:
        seconds = (sum(w * x for w, x in zip(self._weights, fitted_features(
            totals, self.decode_hinge_tokens)))
                   + self.few_rows.get(totals.num_tokens, 0.0))
        if self._runner_scale is None:
            return seconds
        return seconds * self._runner_scale[step_kind(totals) != "decode"]

    def overhead_seconds(self, totals: StepTotals) -> float:
        return sum(w * x for w, x in zip(self._overhead_weights or (0.0,) * 3,
                                         overhead_features(totals)))

    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float:
        return self.predict_totals(StepTotals.of_step(scheduler_output, context_lens))

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step computing `(num_new_tokens, num_cached_tokens)` per request."""
        return self.predict_totals(StepTotals.of_chunks(chunks))


def sample_machines(profile: Mapping, count: int, seed: int = 0) -> list:
    """`count` draws of the machine a trace-fitted profile was measured on, as latency models:
    draw k runs slower or faster than the profile all run long by the k-th of `count`
    evenly spaced quantiles of a log-normal of mean 1 and log-space sigma
    profile["variability"]["run_sigma"] (stratified: a few draws already span the spread),
    and each of its steps by its own seeded log-normal factor of sigma "step_sigma"
    (NoisyLatencyModel, seed `seed + k`). What one simulation cannot show, a real engine's
    run-to-run spread (which step an arrival lands in, which request a cut picks), the mean
    over the draws follows. Each noisy draw carries its own random stream: use it for one
    simulation. count 1, or a profile without "variability": the profile's own
    deterministic model, once per draw. Where the variability records a law per step kind
    (fid15's "kinds": `drift.KindLaw`), each draw is a `drift.KindNoisyModel` on it instead
    (`_kind_machines`): each kind's own run, step and drift sigmas."""
    from statistics import NormalDist

    from tokenweir.sim.drift import KindLaw

    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    model = FittedLatencyModel.from_profile(profile)
    v = profile.get("variability") or {}
    run_sigma, step_sigma = float(v.get("run_sigma", 0.0)), float(v.get("step_sigma", 0.0))
    if count == 1 or not (run_sigma or step_sigma):
        return [model] * count
    law = KindLaw.from_variability(v)
    if law is not None:
        return _kind_machines(model, law, count, seed)
    unit = NormalDist()
    return [NoisyLatencyModel(model, step_sigma, seed=seed + k, scale=math.exp(
        run_sigma * unit.inv_cdf((k + 0.5) / count) - run_sigma * run_sigma / 2))
            for k in range(count)]


def _kind_machines(model, law, count: int, seed: int) -> list:
    """`sample_machines` on a per-kind law (fid16): draw k a `drift.KindNoisyModel` (seed
    `seed + k`), its run units stratified as the kind-blind draws' scale is: decode's the k-th
    of `count` evenly spaced normal quantiles, prefill's correlated run_rho with it through
    the same quantiles in a seeded shuffle (a Latin square: every quantile once per kind)."""
    from statistics import NormalDist

    from tokenweir.sim.drift import KindNoisyModel

    q = [NormalDist().inv_cdf((k + 0.5) / count) for k in range(count)]
    other = q[:]
    random.Random(f"kind-machines/{seed}").shuffle(other)
    rho = max(-1.0, min(1.0, law.run_rho))
    rest = math.sqrt(1.0 - rho * rho)
    return [KindNoisyModel(model, law, step_kind, seed=seed + k,
                           run_units={"decode": q[k], "prefill": rho * q[k] + rest * other[k]})
            for k in range(count)]

