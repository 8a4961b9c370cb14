"""The lab says what it cannot do (no matplotlib) and how far to trust a cost model."""

from __future__ import annotations

import sys

import pytest

from helpers import run_cli


@pytest.fixture
def small_trace(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert run_cli(["lab", "gen", "-q", "--out", str(path), "--num-requests", "12", "--rate", "20",
                  "--prompt-len", "32", "--output-len", "8", "--seed", "3"], capsys)[0] == 0
    return path


def test_replay_without_matplotlib_prints_the_table_then_says_why_no_plots(small_trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out_dir = tmp_path / "out"
    rc, out, err = run_cli(["lab", "replay", str(small_trace), "--simulate", "const:0.01", "--num-kv-blocks", "64",
                          "--max-model-len", "256", "--policy", "fcfs", "--out-dir", str(out_dir)], capsys)
    assert rc == 1
    assert "12 requests" in out and "fcfs" in out and "ttft" in out.lower()  # the results came out
    assert "pip install 'paged[plots]'" in err and "--no-plots" in err
    assert not out_dir.exists()
    rc, out, err = run_cli(["lab", "replay", "-q", str(small_trace), "--simulate", "const:0.01", "--num-kv-blocks", "64",
                          "--max-model-len", "256", "--no-plots"], capsys)
    assert rc == 0 and "matplotlib" not in err


def test_poor_fit_warnings():
    from paged.core.lab.checks import poor_fit_warnings

    assert poor_fit_warnings({"rel_errors": {"ttft_mean": -0.2, "tpot_mean": 0.1, "e2e_mean": None}}) == []
    [warning] = poor_fit_warnings({"rel_errors": {"ttft_mean": -0.55, "tpot_mean": 0.1, "e2e_mean": 0.3}})
    assert warning.startswith("poor fit") and "ttft_mean -55%" in warning and "e2e_mean +30%" in warning
    assert "tpot" not in warning


def test_simulating_outside_the_calibrated_settings_warns(small_trace, tmp_path, capsys):
    from paged.core.lab.cost import CostModel

    cost = CostModel.constant(0.01)
    cost.engine = {"num_blocks": 64, "block_size": 16, "max_model_len": 256, "max_num_seqs": 16,
                   "max_num_batched_tokens": 512, "dtype": "torch.float32", "attention": "torch"}
    cost.validation = {"rel_errors": {"ttft_mean": -0.55, "tpot_mean": 0.02}}
    path = tmp_path / "cost.json"
    cost.save(path)
    rc, _, err = run_cli(["lab", "replay", str(small_trace), "--simulate", str(path), "--no-plots",
                        "--max-num-seqs", "128"], capsys)
    assert rc == 0
    assert "scheduler.max_num_seqs 128 is beyond the calibrated 16" in err
    assert "poor fit" in err and "ttft_mean -55%" in err
    rc, _, err = run_cli(["lab", "replay", str(small_trace), "--simulate", str(path), "--no-plots",
                        "--max-num-seqs", "8", "--max-num-batched-tokens", "256"], capsys)
    assert rc == 0 and "extrapolates" not in err
