"""benchmarks/vs_vidur.py: the attention table it writes for Vidur, the latency model that
prices tokenweir's steps with Vidur's per-op times, and (only where the peer is set up:
benchmarks/peers/setup_vidur.sh) a tiny comparison against Vidur itself."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import vs_vidur  # noqa: E402
from tokenweir.sim.hardware import get_hardware, get_shape  # noqa: E402
from tokenweir.sim.latency import RooflineLatencyModel  # noqa: E402

SHAPE, HW = get_shape(vs_vidur.TOKENWEIR_SHAPE), get_hardware(vs_vidur.TOKENWEIR_HARDWARE)


def test_attention_table_is_the_roofline_per_layer():
    """A decode is memory-bound: the table's attention + save per layer, times the layers,
    grows with the context exactly as tokenweir's roofline step does."""
    roofline = RooflineLatencyModel(SHAPE, HW)
    per_layer = [sum(vs_vidur.attention_ms(SHAPE, HW, 1, 1, c)) for c in (1000, 3000)]
    table_growth = (per_layer[1] - per_layer[0]) * SHAPE.num_layers / 1e3
    roofline_growth = roofline.step_time([(1, 3000)]) - roofline.step_time([(1, 1000)])
    assert table_growth == pytest.approx(roofline_growth, rel=1e-9)
    # a long prefill chunk is compute-bound: FLOPs, not bytes, set its time
    attention, _ = vs_vidur.attention_ms(SHAPE, HW, 1, 512, 0)
    flops = 4 * SHAPE.num_heads * SHAPE.head_dim * 512 * (513 / 2)
    assert attention == pytest.approx(flops / HW.effective_flops * 1e3)


def test_attention_table_schema(tmp_path):
    path = tmp_path / "attention.csv"
    rows = vs_vidur.write_attention_table(path, max_len=256, max_batch=4)
    lines = path.read_text().splitlines()
    assert len(lines) == rows + 1
    header = lines[0].split(",")
    for op in vs_vidur.TIMED_OPS:
        assert f"time_stats.{op}.median" in header
    for column in ("n_embd", "n_q_head", "n_kv_head", "block_size", "batch_size",
                   "prefill_chunk_size", "kv_cache_size", "num_tensor_parallel_workers"):
        assert column in header
    is_prefill = header.index("is_prefill")
    decode_rows = [line for line in lines[1:] if line.split(",")[is_prefill] == "False"]
    assert len(decode_rows) == 4 * len(range(32, 256 + 1, 32))  # contexts 32..256 x batch 1..4
    assert all(line.split(",")[header.index("time_stats.attn_prefill.median")] == ""
               for line in decode_rows)


def fake_op_times(linear_ms: float = 0.01, decode_ms: float = 0.02,
                  prefill_ms: float = 0.05) -> dict:
    """Op times in the runner's format, constant per op (no peer needed)."""
    n = vs_vidur.MAX_TOKENS
    ops = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act",
           "attn_rope", "attn_kv_cache_save", "input_layernorm", "post_attention_layernorm", "add")
    linear = {op: [linear_ms] * n for op in ops}
    linear["attn_kv_cache_save"] = [0.001 * k for k in range(1, n + 1)]  # at the exact count
    kvs = range(0, n + 1, 64)
    return {"num_layers": 32, "kv_granularity": 64, "linear": linear,
            "attn_decode": [[b, kv, decode_ms * b] for b in range(1, 129) for kv in kvs],
            "attn_prefill": [[kv, q * q, prefill_ms] for kv in kvs
                             for q in [*range(1, 513), 2048]]}  # 2048: the pool probe


def test_op_times_model_prices_a_step_as_vidur_does():
    model = vs_vidur.VidurOpTimesModel(fake_op_times())
    # 3 decodes + one 100-token chunk: 103 tokens -> linear ops at 104, KV save at 103
    step = model.step_time([(1, 10), (1, 20), (1, 30), (100, 64)])
    per_layer = 9 * 0.01 + 0.001 * 103 + 0.02 * 3 + 0.05
    assert step == pytest.approx(per_layer * 32 / 1e3)
    assert model.step_time([]) == 0.0


def test_op_times_model_drives_a_simulation():
    specs = vs_vidur.workload(40, 20.0, seed=3)
    run = vs_vidur.run_tokenweir(specs, 2, vs_vidur.VidurOpTimesModel(fake_op_times()))
    assert all(r["finished"] is not None for r in run["requests"])
    assert len(run["requests"]) == 40 and run["run_seconds"] > 0
    p = vs_vidur.predictions(run)
    assert p.finished == 40 and p.tpot["p50"] > 0 and not math.isnan(p.ttft["p90"])


PEER_MISSING = vs_vidur.peer_available()


@pytest.mark.skipif(PEER_MISSING is not None, reason=f"Vidur peer: {PEER_MISSING}")
def test_tiny_comparison_against_vidur(tmp_path):
    """Vidur really ran (its own records, its predictor read the table written here), and on
    a light load the two simulators agree on what the load decides."""
    r = vs_vidur.compare(100, 2, tmp_path, core=None, rate_per_replica=6.0)
    vidur, tw = r["vidur"], r["tokenweir"]
    assert len(vidur["requests"]) == len(tw["requests"]) == 100
    assert vidur["run_seconds"] > 0
    assert all(x["finished"] is not None for x in vidur["requests"] + tw["requests"])
    # Vidur's fitted decode attention follows the roofline table (its random forest, not ours)
    decode = {(b, kv): t for b, kv, t in r["op_times"]["attn_decode"]}
    expected, _ = vs_vidur.attention_ms(SHAPE, HW, 8, 1, 1024)  # a row of the table
    assert decode[(8, 1024)] == pytest.approx(expected, rel=0.10)  # measured: within 0.1%
    rows = {name: (a, b) for name, a, b, *_ in r["rows"]}
    a, b = rows["throughput req/s"]
    assert a == pytest.approx(b, rel=0.05)  # both keep up with the same arrivals
    a, b = rows["TPOT p50 ms"]
    assert a == pytest.approx(b, rel=0.25)
    # fed the same op times, on a light load most requests follow the very same timeline
    # (measured: all of them); the own-roofline column is a different model, so differs
    assert r["same_timelines"] >= 50
    assert rows["TPOT p50 ms"][0] != next(own for name, *_, own in r["rows"]
                                          if name == "TPOT p50 ms")


def test_whole_prompt_admission_holds_back_what_chunked_admission_lets_in():
    """On a pool that 12 req/s over-commits, admitting chunk by chunk (fcfs) preempts; the
    Sarathi rule (whole prompt above the watermark) preempts less, and every request still
    finishes on both."""
    specs = vs_vidur.workload(300, 12.0, seed=1)
    model = vs_vidur.VidurOpTimesModel(fake_op_times(linear_ms=0.03, decode_ms=0.004))
    fcfs = vs_vidur.run_tokenweir(specs, 1, model)
    whole = vs_vidur.run_tokenweir(specs, 1, model, vs_vidur.WHOLE_PROMPT)
    preemptions = [sum(r["restarts"] for r in run["requests"]) for run in (fcfs, whole)]
    assert preemptions[0] > 0  # the pool really was over-committed under fcfs
    assert preemptions[1] < preemptions[0]
    for run in (fcfs, whole):
        assert all(r["finished"] is not None for r in run["requests"])
