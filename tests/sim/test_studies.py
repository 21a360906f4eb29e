"""`tokenweir study` and `tokenweir sweep` write CSV + PNG with the expected shape. Small
workloads on the default 7B/H100 shape keep each a few seconds."""

from __future__ import annotations

import csv

from tokenweir.cli import main as cli_main
from tokenweir.sim.studies import default_pool_grid

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(argv: list[str]) -> int:
    return cli_main(argv)


def _outputs(out_dir, name):
    rows = list(csv.DictReader((out_dir / f"{name}.csv").open()))
    png = (out_dir / f"{name}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000  # a real image, not an empty file
    return rows


def test_frontier_trades_ttft_for_itl(tmp_path, capsys):
    assert _cli(["study", "frontier", "--out-dir", str(tmp_path), "--jobs", "1",
                 "--long-prompt", "8000", "--num-decodes", "8", "--decode-output", "300",
                 "--long-arrival", "0.05", "--chunks", "256,1024,4096"]) == 0
    rows = _outputs(tmp_path, "frontier")
    assert [int(r["chunk"]) for r in rows] == [256, 1024, 4096]
    ttft = [float(r["long_ttft_ms"]) for r in rows]
    itl = [float(r["itl_p99_ms"]) for r in rows]
    assert ttft[0] > ttft[1] > ttft[2]  # bigger chunks: the long prompt is done sooner
    assert itl[0] < itl[1] < itl[2]  # ... and the decodes stall longer per step
    assert [int(r["prefill_steps"]) for r in rows][0] >= 8000 // 256  # it really chunked
    assert "long_ttft_ms" in capsys.readouterr().out


def test_pool_study_shows_the_hockey_stick(tmp_path):
    assert _cli(["study", "pool", "--out-dir", str(tmp_path), "--jobs", "2",
                 "--num-requests", "40", "--prompt-len", "lognormal:256:0.4",
                 "--output-len", "lognormal:128:0.4"]) == 0
    rows = _outputs(tmp_path, "pool")
    blocks = [int(r["blocks"]) for r in rows]
    steps = [int(r["num_steps"]) for r in rows]
    preemptions = [int(r["preemptions"]) for r in rows]
    assert blocks == sorted(blocks) and len(blocks) >= 5
    assert preemptions[0] > 0 and preemptions[-1] == 0  # cramped preempts, roomy does not
    assert steps[0] > 3 * steps[-1]  # the stick: a small pool multiplies the steps
    assert all(a >= b for a, b in zip(steps[-3:], steps[-2:]))  # flat at the roomy end


def test_policies_study_covers_every_victim_and_mode(tmp_path):
    assert _cli(["study", "policies", "--out-dir", str(tmp_path), "--jobs", "2",
                 "--num-requests", "60", "--request-rate", "20", "--prompt-len",
                 "lognormal:256:0.4", "--output-len", "lognormal:128:0.4"]) == 0
    rows = _outputs(tmp_path, "policies")
    assert [(r["victim"], r["mode"]) for r in rows] == [
        (v, m) for v in ("fcfs", "priority", "cost") for m in ("recompute", "swap", "auto")]
    for r in rows:
        assert int(r["preemptions"]) > 0  # the workload is really memory-pressured
        if r["mode"] == "swap":
            assert int(r["swapped_out"]) == int(r["preemptions"])
            assert float(r["recompute_tax"]) == 0.0
        if r["mode"] == "recompute":
            assert int(r["swapped_out"]) == 0 and float(r["recompute_tax"]) > 0


def test_sweep_plots_beside_its_csv(tmp_path):
    out = tmp_path / "s.csv"
    assert _cli(["sweep", "--set", "max_num_batched_tokens=128,512", "--set",
                 "enable_prefix_caching=true,false", "--model-shape", "smollm2-135m",
                 "--num-requests", "20", "--request-rate", "100", "--prompt-len", "fixed:100",
                 "--output-len", "fixed:4", "--num-gpu-blocks-override", "200",
                 "--max-model-len", "256", "--jobs", "1", "--out", str(out)]) == 0
    assert len(list(csv.DictReader(out.open()))) == 4
    assert (tmp_path / "s.png").read_bytes().startswith(PNG_MAGIC)


def test_default_pool_grid_spans_smallest_to_roomy():
    grid = default_pool_grid(100, 10_000)
    assert grid[0] == 100 and grid[-1] == 10_000 and grid == sorted(set(grid))
    assert default_pool_grid(50, 40) == [50]
