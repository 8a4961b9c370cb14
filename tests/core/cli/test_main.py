"""`paged`'s command line as a new user meets it: help, did-you-mean, abbreviations refused, errors
before the model loads, `paged config`, the announced kernel build."""

from __future__ import annotations

import os

import pytest

from helpers import REPO_ROOT, run_cli


def test_run_help_has_typed_metavars_help_for_sampling_and_no_server_flags(capsys):
    rc, out, _ = run_cli(["run", "--help"], capsys)
    assert rc == 0
    assert "SP:" not in out and "CFG:" not in out
    assert "--max-model-len INT" in out and "--temperature FLOAT" in out and "--dtype {auto,float32" in out
    from paged.core.cli.main import build_parser

    run = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)  # the subcommands
    sampling = [a for a in run.choices["run"]._actions if a.dest.startswith("sp:")]
    assert len(sampling) >= 15 and all(a.help for a in sampling), [a.dest for a in sampling if not a.help]
    assert "--api-key" not in out and "--host" not in out and "--served-model-name" not in out
    rc, out, _ = run_cli(["serve", "--help"], capsys)
    assert rc == 0 and "--api-key" in out and "--served-model-name" in out
    rc, out, _ = run_cli(["lab", "--help"], capsys)
    assert rc == 0 and "``" not in out


def test_misspelled_flag_suggests_the_right_one(capsys):
    rc, _, err = run_cli(["run", "--polcy=priority", "hello"], capsys)
    assert rc == 2
    assert "paged run: error: unrecognized arguments: --polcy=priority (did you mean --policy?)" in err
    rc, _, err = run_cli(["config", "--max-numseqs", "3"], capsys)
    assert rc == 2 and "did you mean --max-num-seqs?" in err


def test_abbreviated_flags_are_errors_that_suggest_the_whole_flag(capsys):
    """argparse would take --max-token as --max-tokens (issue 23 item 8): a typo, or a flag added
    later, would then pick another flag without a word."""
    rc, _, err = run_cli(["run", "--max-token", "8", "hello"], capsys)
    assert rc == 2
    assert "paged run: error: unrecognized arguments: --max-token (did you mean --max-tokens?)" in err
    rc, _, err = run_cli(["run", "hello", "--max-token=8"], capsys)
    assert rc == 2 and "--max-token=8 (did you mean --max-tokens?)" in err
    rc, _, err = run_cli(["config", "--max-num-seq", "3"], capsys)
    assert rc == 2 and "paged config: error: unrecognized arguments: --max-num-seq (did you mean --max-num-seqs?)" in err
    rc, _, err = run_cli(["lab", "gen", "--out", "t.jsonl", "--num-request", "5"], capsys)
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

    rc, out, _ = run_cli(["bench", "serve", "--help"], capsys)  # the benchmark's own help
    assert rc == 0 and "usage: paged bench serve" in out and "--max-concurrency" in out
    assert benchmark_script("serve") == REPO_ROOT / "benchmarks" / "serve.py"
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
    rc, _, err = run_cli(["run", "--temperature", "-1", "hello"], capsys)
    assert rc == 2 and "temperature: invalid value -1.0" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "top_p": 7}\n')
    rc, _, err = run_cli(["run", "--prompts-file", str(prompts)], capsys)
    assert rc == 2 and "prompt 2: top_p: invalid value 7" in err


def test_paged_config_shows_what_will_run_with_typed_values(capsys):
    import json

    from helpers.default_model import default_gguf

    rc, out, _ = run_cli(["config", "--json", "--device", "cpu", "--policy", "priority",
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
    rc, out, _ = run_cli(["config", "--device", "cpu"], capsys)
    assert rc == 0 and "# what will run here" in out and "#   attention_backend: torch" in out


def test_cpu_kernel_build_is_announced_and_timed(tmp_path, monkeypatch, caplog):
    import logging

    import torch
    from torch.utils import cpp_extension

    from paged.backends import cpu_paged_decode
    from paged.core import native

    if cpu_paged_decode.load() is None:
        pytest.skip("no C++ compiler: the backend falls back to gather + SDPA")
    real_so = native.library_path(cpu_paged_decode.build_name())
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
