"""`tokenweir simulate --samples N` (issue 16): N simulations, each a draw of the machine a
trace-fitted profile measured (its "variability"), reported as each metric's mean and spread."""

from __future__ import annotations

import json
import statistics

import pytest

from tokenweir.cli import main as cli_main

PROFILE = {"format": "tokenweir-step-profile/1",
           "coefficients": {"const": 0.004, "prefill_tokens": 2e-4, "decode_rows": 1e-3},
           "overhead": {"const": 4e-4}, "kv_bytes_per_token": 1024, "block_size": 16,
           "max_model_len": 512, "model": "test", "num_layers": 8}
WORKLOAD = ["--num-requests", "40", "--request-rate", "30", "--prompt-len", "uniform:20:200",
            "--output-len", "uniform:4:40", "--num-gpu-blocks-override", "300"]


def write(tmp_path, profile: dict):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_samples_report_the_mean_of_draws_of_the_machine(tmp_path, capsys):
    noisy = write(tmp_path, {**PROFILE, "variability": {"run_sigma": 0.05, "step_sigma": 0.03}})
    out = tmp_path / "draws.json"
    assert cli_main(["simulate", "--profile", noisy, *WORKLOAD, "--samples", "4",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean of 4 draws" in text and "run to run 5.0%" in text
    assert "spread over the draws" in text
    data = json.loads(out.read_text())
    draws = data["draws"]
    # the probe: the draws really are different machines
    assert len(draws) == 4 and len({d["sim_seconds"] for d in draws}) == 4
    assert data["mean"]["tpot_p50_ms"] == pytest.approx(
        statistics.fmean(d["tpot_p50_ms"] for d in draws))
    assert data["mean"]["num_finished"] == 40
    # the deterministic run sits inside the draws' spread
    det = tmp_path / "det.json"
    assert cli_main(["simulate", "--profile", noisy, *WORKLOAD, "--json", str(det)]) == 0
    one = json.loads(det.read_text())
    assert min(d["sim_seconds"] for d in draws) < one["sim_seconds"] \
        < max(d["sim_seconds"] for d in draws)


def test_samples_need_a_profile_with_variability(tmp_path, capsys):
    plain = write(tmp_path, PROFILE)
    assert cli_main(["simulate", "--profile", plain, *WORKLOAD, "--samples", "3"]) == 2
    assert "measured no variability" in capsys.readouterr().err
    assert cli_main(["simulate", *WORKLOAD, "--samples", "3"]) == 2
    assert "give --profile" in capsys.readouterr().err
    noisy = write(tmp_path, {**PROFILE, "variability": {"run_sigma": 0.05, "step_sigma": 0.0}})
    assert cli_main(["simulate", "--profile", noisy, *WORKLOAD, "--samples", "3",
                     "--num-instances", "2"]) == 2
    assert "one instance" in capsys.readouterr().err
