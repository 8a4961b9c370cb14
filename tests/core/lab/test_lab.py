"""The policy lab: traces, replays (real engine and simulated), the cost model, reports, plugins.

Real replays use a tiny random-weight Llama (1 layer, hidden 32) with the default model's
tokenizer, so that they take seconds. Timing-sensitive checks use the CPU clock (the process's
CPU time per step), which other processes on the machine do not inflate.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES
from helpers.tiny_llama import save_tiny_llama

from paged.core.cli.main import main as paged_main
from paged.core.config import load_config
from paged.core.errors import ConfigError
from paged.core.lab.calibrate import calibrate, validate
from paged.core.lab.cost import CostModel
from paged.core.lab.metrics import format_table, summarize
from paged.core.lab.replay import PolicyRun, SimExecutor, SimSettings, materialize, replay_trace, run_replay
from paged.core.lab.trace import (
    GeneratorSpec,
    Trace,
    TraceError,
    TraceRequest,
    generate_trace,
    read_trace,
    write_trace,
)

FIXTURE = FIXTURES / "paged-example-plugin"


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """A random-weight 1-layer Llama (hidden 32) with the default model's tokenizer, fp32."""
    path = tmp_path_factory.mktemp("tiny-lab-llama")
    save_tiny_llama(path, default_model_dir, vocab_size=49152, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    return str(path)


def tiny_config(model: str, **scheduler):
    return load_config(overrides={
        "device": "cpu", "model": {"model": model, "max_model_len": 512},
        "cache": {"num_blocks": 96, "block_size": 16},
        "scheduler": {"max_num_seqs": 6, "max_num_batched_tokens": 256, **scheduler},
    })


def small_trace(seed: int = 3, n: int = 24, rate: float = 60.0) -> Trace:
    return generate_trace(GeneratorSpec(
        num_requests=n, rate=rate, arrival="bursty", burstiness=0.3, prompt_len_median=40, prompt_len_max=160,
        output_len_median=10, output_len_min=2, output_len_max=24, shared_prefix_frac=0.4, num_prefixes=2,
        prefix_len=32, priority_classes=2, priority_weights=[0.25, 0.75], seed=seed,
    ))


SIM_SETTINGS = dict(num_blocks=60, block_size=16, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048)


def sim_config(**scheduler):
    return load_config(overrides={
        "model": {"max_model_len": SIM_SETTINGS["max_model_len"]}, "cache": {"num_blocks": SIM_SETTINGS["num_blocks"]},
        "scheduler": {"max_num_seqs": SIM_SETTINGS["max_num_seqs"],
                      "max_num_batched_tokens": SIM_SETTINGS["max_num_batched_tokens"], **scheduler},
    })


# --- traces ---------------------------------------------------------------------------------------------
def test_trace_round_trip_and_seeded_generator(tmp_path):
    spec = GeneratorSpec(num_requests=50, rate=5, arrival="bursty", shared_prefix_frac=0.5, priority_classes=3,
                         priority_weights=[0.2, 0.3, 0.5], seed=7)
    trace = generate_trace(spec)
    # hand-written lines: every prompt kind, sampling fields, cache salt
    trace.requests += [
        TraceRequest(arrival_s=20.0, id="text", prompt="Hello there", sampling={"temperature": 0.5}, output_len=5),
        TraceRequest(arrival_s=21.5, id="ids", prompt_token_ids=[1, 2, 3], max_tokens=4, priority=1, cache_salt="a"),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    back = read_trace(path)
    assert back.requests == trace.requests
    assert back.header["paged_trace"] == 1 and back.header["seed"] == 7 and back.header["params"]["rate"] == 5
    write_trace(tmp_path / "again.jsonl", back)
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()

    # seeded: the same spec gives the same trace, another seed another one
    assert generate_trace(spec).requests == trace.requests[:50]
    other = generate_trace(GeneratorSpec(**{**spec.__dict__, "seed": 8}))
    assert other.requests != trace.requests[:50]
    arrivals = [r.arrival_s for r in trace.requests[:50]]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert {r.priority for r in trace.requests[:50]} == {0, 1, 2}
    assert any(r.prefix for r in trace.requests[:50]) and not all(r.prefix for r in trace.requests[:50])

    # token ids of length-only prompts: seeded; requests naming one prefix share its ids
    a = materialize(Trace(trace.requests[:50], trace.header))
    b = materialize(read_trace(path), max_requests=50)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    by_prefix: dict[int, list] = {}
    for line, req in zip(trace.requests, sorted(a, key=lambda r: int(r.id[1:]))):
        assert len(req.prompt_token_ids) == line.prompt_len and req.output_len == line.max_tokens
        if line.prefix:
            by_prefix.setdefault(line.prefix["id"], []).append(req.prompt_token_ids[: line.prefix["len"]])
    assert by_prefix and all(all(p == ps[0] for p in ps) for ps in by_prefix.values())
    assert materialize(trace, seed=99, max_requests=50)[0].prompt_token_ids != a[0].prompt_token_ids


def test_bad_trace_lines_name_the_line_and_field(tmp_path):
    cases = {
        '{"arrival_s": -1, "prompt_len": 3}': "arrival_s",
        '{"arrival_s": 0}': "needs one of",
        '{"arrival_s": 0, "prompt_len": 3, "colour": 1}': "unknown field",
        '{"arrival_s": 0, "prompt_len": 3, "prefix": {"id": 0, "len": 5}}': "prefix",
        "not json": "invalid JSON",
    }
    for line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text('{"arrival_s": 0, "prompt_len": 4}\n' + line + "\n")
        with pytest.raises(TraceError, match=message) as e:
            read_trace(path)
        assert "line 2" in str(e.value)


# --- simulation ------------------------------------------------------------------------------------------
def test_simulation_is_deterministic_step_by_step():
    trace = generate_trace(GeneratorSpec(num_requests=150, rate=30, arrival="bursty", shared_prefix_frac=0.3,
                                         prompt_len_max=600, priority_classes=2, seed=11))
    cost = CostModel([0.004, 2e-5, 1e-4, 2e-4, 3e-4, 1e-3, 0.01])
    runs = [replay_trace(trace, [PolicyRun("fcfs"), PolicyRun("priority")], sim_config(), mode="sim", cost=cost)
            for _ in range(2)]
    for first, second in zip(*runs):
        assert first.schedule_digest == second.schedule_digest
        assert [(s.schedule_key(), s.t_start, s.t_end) for s in first.steps] == [
            (s.schedule_key(), s.t_start, s.t_end) for s in second.steps
        ]
        assert [(r.first_token, r.finished) for r in first.requests] == [(r.first_token, r.finished) for r in second.requests]
        assert all(r.num_generated == r.output_len for r in first.requests)
    assert runs[0][0].schedule_digest != runs[0][1].schedule_digest  # the policies did schedule differently


@pytest.fixture(scope="module")
def priority_report(tmp_path_factory):
    """`paged lab replay --simulate` on a bursty trace, 20% high priority, 4 seats, small KV cache."""
    tmp = tmp_path_factory.mktemp("lab-report")
    trace_path = tmp / "bursty.jsonl"
    code = paged_main(["lab", "gen", "-q", "--out", str(trace_path), "--num-requests", "200", "--rate", "8",
                       "--arrival", "bursty", "--burstiness", "0.2", "--priority-classes", "2",
                       "--priority-weights", "0.2,0.8", "--prompt-len", "200", "--prompt-len-max", "600",
                       "--output-len", "48", "--seed", "5"])
    assert code == 0
    out_dir = tmp / "out"
    # The replay runs here, not in the first test that needs it: every test gets its output
    # whatever the order or selection (-k) of the tests.
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = paged_main(["lab", "replay", "-q", str(trace_path), "--simulate", "const:0.02", "--policy", "fcfs",
                           "--policy", "priority", "--num-kv-blocks", "60", "--max-num-seqs", "4",
                           "--max-model-len", "2048", "--slo-ttft", "1.0", "--out-dir", str(out_dir), "--html", "--json"])
    assert code == 0
    return out_dir, json.loads(stdout.getvalue())


def test_priority_beats_fcfs_on_the_high_priority_p99_ttft(priority_report):
    out_dir, doc = priority_report
    by_label = {s["label"]: s for s in doc["summaries"]}
    fcfs, prio = by_label["fcfs"]["classes"]["0"], by_label["priority"]["classes"]["0"]
    assert prio["ttft"]["p99"] < 0.5 * fcfs["ttft"]["p99"], (prio["ttft"], fcfs["ttft"])
    assert prio["slo_attainment"] > fcfs["slo_attainment"]
    # ... and the lab's table shows it, class by class
    table = (out_dir / "summary.txt").read_text()
    assert "[priority class 0]" in table and "[priority class 1]" in table and "fcfs" in table and "priority" in table
    assert by_label["fcfs"]["all"]["requests"] == 200 and by_label["priority"]["all"]["finished"] == 200


def test_report_files_are_written(priority_report):
    out_dir, _ = priority_report
    for name in ("timeline.png", "ttft_cdf.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    page = (out_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "<table>" in page and "TTFT p99" in page
    results = json.loads((out_dir / "results.json").read_text())
    assert [r["label"] for r in results["replays"]] == ["fcfs", "priority"]
    assert results["replays"][0]["steps"][0]["num_seqs"] >= 1


def test_report_api_writes_pictures_for_a_tiny_replay(tmp_path):
    from paged.core.lab.report import write_report

    results = replay_trace(small_trace(n=10), [PolicyRun("fcfs")], sim_config(), mode="sim", cost=CostModel.constant(0.01))
    files = write_report(results, [summarize(r) for r in results], tmp_path, {"trace": "small"}, html_page=True)
    assert all(Path(p).stat().st_size > 0 for p in files.values())
    assert set(files) == {"timeline", "ttft_cdf", "results", "summary", "html"}


def test_policy_specs_and_options():
    run = PolicyRun.parse("priority:aging_s=5")
    assert run.label == "priority:aging_s=5" and run.options == {"aging_s": "5"}
    _, options, policy = run.build()
    assert options.aging_s == 5.0 and policy.options.aging_s == 5.0
    with pytest.raises(ConfigError, match="aging_s"):
        PolicyRun.parse("priority:aging_s=-1").build()
    with pytest.raises(ConfigError, match="takes no options"):
        PolicyRun.parse("fcfs:x=1").build()
    with pytest.raises(ConfigError, match="Did you mean 'priority'"):
        PolicyRun.parse("priorty").build()
    # --policy-option applies to the --policy before it
    from paged.core.cli.main import build_parser

    args = build_parser().parse_args(["lab", "replay", "t.jsonl", "--policy", "fcfs", "--policy", "priority",
                                      "--policy-option", "aging_s=2", "--policy", "priority:aging_s=9"])
    assert [r.label for r in args.lab_policies] == ["fcfs", "priority:aging_s=2", "priority:aging_s=9"]


# --- real engine -----------------------------------------------------------------------------------------------
def test_real_replay_with_the_step_clock_is_reproducible_and_matches_the_simulator(tiny_model):
    trace = small_trace()
    config = tiny_config(tiny_model)
    policies = [PolicyRun("fcfs"), PolicyRun("priority")]
    first = replay_trace(trace, policies, config, mode="steps", step_time=0.01)
    second = replay_trace(trace, policies, config, mode="steps", step_time=0.01)
    sim = replay_trace(trace, policies, config, mode="sim", cost=CostModel.constant(0.01))
    for a, b, s in zip(first, second, sim):
        assert a.schedule_digest == b.schedule_digest == s.schedule_digest
        assert [x.schedule_key() for x in a.steps] == [x.schedule_key() for x in b.steps] == [x.schedule_key() for x in s.steps]
        assert all(r.num_generated == r.output_len and r.finished is not None for r in a.requests)
        assert a.engine_prefix_hit_rate > 0  # the shared prefixes were found
    assert first[0].schedule_digest != first[1].schedule_digest


def test_a_replay_with_speculation_reports_its_acceptance(tiny_model):
    """On the engine with ``ngram`` (every batch size), a trace of repetitive prompts: the replay
    carries the speculator's counters, they add up (accepted <= drafted, each verified step
    advanced 1 + accepted / verified tokens), the replay takes fewer steps than without
    speculation with every request getting all its tokens, and the table has the two rows; a
    replay without speculation has neither."""
    trace = Trace([TraceRequest(0.01 * i, id=f"r{i}", prompt_token_ids=[5, 6, 7, 8] * 6 + [9 + i], output_len=24,
                                sampling={"temperature": 0.0}) for i in range(4)], {"source": "test"})
    spec = {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}}
    config = tiny_config(tiny_model)
    config_spec = load_config(overrides={**spec, "model": {"model": tiny_model, "max_model_len": 512},
                                         "cache": {"num_blocks": 64}, "device": "cpu"})
    (plain,) = replay_trace(trace, [PolicyRun("fcfs")], config, mode="steps", step_time=0.01)
    (result,) = replay_trace(trace, [PolicyRun("fcfs")], config_spec, mode="steps", step_time=0.01)
    stats = result.spec_decode
    assert plain.spec_decode is None and stats["method"] == "ngram"
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"] <= 3 * stats["num_drafts"]
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"],
                                                          abs=1e-3)
    assert all(r.num_generated == 24 and r.finished is not None for r in result.requests)
    assert len(result.steps) < len(plain.steps)
    table = format_table([summarize(plain), summarize(result)])
    assert "drafts accepted" in table and "tokens per verified step" in table
    assert "drafts accepted" not in format_table([summarize(plain)])


def test_calibration_fits_and_validation_reports_errors(tiny_model):
    """Calibrate on the tiny model (CPU clock), then validate on a Poisson trace, real and simulated.
    How close the simulator comes is a measurement of this machine at this moment (per-step CPU times on
    a shared 2-core machine vary by +-20%), so it is printed, and measured by ``paged lab calibrate``, not
    asserted here; what is asserted does not depend on the clock."""
    config = tiny_config(tiny_model)
    cost, calibration = calibrate(config, clock="cpu", scale=2)
    assert cost.fit["num_steps"] > 150 and cost.coef[0] > 0
    out = validate(cost, config, clock="cpu")
    assert out["real"]["steps"] > 50 and out["num_requests"] >= 16
    errors = out["rel_errors"]
    assert all(math.isfinite(errors[k]) for k in ("e2e_mean", "tpot_mean")), errors
    print("sim vs real:", errors, "fit:", cost.fit)


def test_paged_run_records_a_trace_that_replays(tiny_model, tmp_path, capsys):
    path = tmp_path / "served.jsonl"
    code = paged_main(["run", "-q", "--model", tiny_model, "--device", "cpu", "--num-kv-blocks", "64",
                       "--max-tokens", "5", "--ignore-eos", "--priority", "1", "--record-trace", str(path),
                       "Hello there", "The capital of France is"])
    assert code == 0
    capsys.readouterr()
    trace = read_trace(path)
    assert trace.header["source"] == "paged run" and len(trace) == 2
    first = trace.requests[0]
    assert first.prompt == "Hello there" and first.prompt_token_ids and first.output_len == 5
    assert first.priority == 1 and first.sampling["temperature"] == 0.0 and first.sampling["ignore_eos"] is True
    results = replay_trace(trace, [], load_config(overrides={"model": {"max_model_len": 512},
                                                            "cache": {"num_blocks": 64}}),
                           mode="sim", cost=CostModel.constant(0.01))
    assert [r.num_generated for r in results[0].requests] == [5, 5]
    assert [r.prompt_len for r in results[0].requests] == [len(r.prompt_token_ids) for r in trace.requests]


def test_calibrate_replay_and_validate_from_the_command_line(tiny_model, tmp_path, capsys):
    engine_flags = ["--model", tiny_model, "--device", "cpu", "--num-kv-blocks", "96", "--max-num-seqs", "6",
                    "--max-model-len", "512", "--max-num-batched-tokens", "256"]
    cost_path = tmp_path / "cost.json"
    assert paged_main(["lab", "calibrate", "-q", "--out", str(cost_path), "--clock", "cpu", "--scale", "0.5",
                       "--no-validate", *engine_flags]) == 0
    assert "R^2" in capsys.readouterr().out
    cost = CostModel.load(cost_path)
    assert cost.clock == "cpu" and cost.engine["num_blocks"] == 96 and cost.engine["max_model_len"] == 512
    assert cost.fit["num_steps"] > 50 and all(c >= 0 for c in cost.coef)
    # the simulator takes the KV cache size and max_model_len from the cost model's engine
    trace = tmp_path / "t.jsonl"
    write_trace(trace, small_trace(n=16))
    assert paged_main(["lab", "replay", "-q", str(trace), "--simulate", str(cost_path), "--policy", "priority",
                       "--no-plots", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["settings"]["num_blocks"] == 96 and doc["meta"]["cost_model"]["clock"] == "cpu"
    assert doc["summaries"][0]["all"]["finished"] == 16
    assert paged_main(["lab", "validate", "-q", str(trace), "--cost", str(cost_path), "--json", *engine_flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_requests"] == 16 and set(out["rel_errors"]) >= {"ttft_mean", "tpot_mean", "e2e_mean"}


def test_lab_policies_lists_policies_with_their_options(capsys):
    assert paged_main(["lab", "policies", "--json"]) == 0
    policies = {p["name"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    assert {"fcfs", "priority"} <= set(policies)
    assert policies["priority"]["options"][0]["name"] == "aging_s" and policies["fcfs"]["options"] == []


# --- third-party policies ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def example_plugin_site(tmp_path_factory):
    """The example plugin pip-installed into its own target directory (as in test_plugins)."""
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("build") / "paged-example-plugin"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_a_third_party_policy_replays_in_the_simulator_with_its_option(example_plugin_site, tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, small_trace(n=40))
    env = dict(os.environ, PYTHONPATH=str(example_plugin_site), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "paged.core.cli", "lab", "replay", "-q", str(trace), "--simulate", "const:0.01",
         "--num-kv-blocks", "60", "--max-num-seqs", "4", "--max-model-len", "1024", "--policy", "fcfs",
         "--policy", "shortest-first", "--policy-option", "tokens_per_s=3", "--no-plots", "--json"],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    labels = [s["label"] for s in doc["summaries"]]
    assert labels == ["fcfs", "shortest-first:tokens_per_s=3"]
    assert all(s["all"]["finished"] == 40 for s in doc["summaries"])
    assert doc["summaries"][0]["all"]["ttft"] != doc["summaries"][1]["all"]["ttft"]
    # a bad option value is refused by the plugin's own options model
    bad = subprocess.run(
        [sys.executable, "-m", "paged.core.cli", "lab", "replay", "-q", str(trace), "--simulate", "const:0.01",
         "--num-kv-blocks", "60", "--policy", "shortest-first:tokens_per_s=-2", "--no-plots"],
        capture_output=True, text=True, env=env,
    )
    assert bad.returncode == 2 and "tokens_per_s" in bad.stderr, bad.stderr


def test_table_formatting_lists_every_policy_column():
    results = replay_trace(small_trace(n=12), [PolicyRun("fcfs"), PolicyRun.parse("priority:aging_s=1")],
                           sim_config(), mode="sim", cost=CostModel.constant(0.01))
    table = format_table([summarize(r, slo_ttft=0.5) for r in results])
    header = table.splitlines()[0]
    assert "fcfs" in header and "priority:aging_s=1" in header
    assert "SLO attainment" in table and "goodput req/s" in table


def test_run_replay_rejects_requests_that_can_never_fit():
    trace = Trace([TraceRequest(arrival_s=0.0, id="big", prompt_len=3000, max_tokens=10)])
    settings = SimSettings(**SIM_SETTINGS)
    _, _, policy = PolicyRun("fcfs").build()
    with pytest.raises(Exception, match="big"):
        run_replay(materialize(trace), SimExecutor(policy, settings), cost=CostModel.constant(0.01))


def test_the_trace_recorder_keeps_constraints_and_logit_bias_and_never_stops_serving(tmp_path, caplog):
    """A served request with a structured-output constraint and a logit bias is recorded so that
    replaying reads the same sampling back; a request the trace cannot hold is logged and skipped
    (it once failed the server's whole output handler)."""
    from types import SimpleNamespace

    from paged.core.lab.trace import TraceRecorder, read_trace
    from paged.core.sampling_params import SamplingParams

    def output(request_id):
        return SimpleNamespace(request_id=request_id, prompt_token_ids=[1, 2, 3], metrics=None,
                               outputs=[SimpleNamespace(token_ids=[4, 5], metrics=None)])

    params = SamplingParams(max_tokens=5, structured_output={"json_object": True}, logit_bias={7: -2.5})
    recorder = TraceRecorder(tmp_path / "t.jsonl", "test")
    recorder.add("a", params, 0, "hi")
    recorder.add("b", SamplingParams(stop=["x"]), 0, None)
    recorder._pending["b"] = (object(), 0, None)  # parameters the trace cannot read
    recorder.finish(output("b"))
    recorder.finish(output("a"))
    recorder.close()
    (only,) = read_trace(tmp_path / "t.jsonl").requests
    again = SamplingParams.from_dict(only.sampling)
    assert (again.structured_output, again.logit_bias, again.max_tokens) == \
        (params.structured_output, params.logit_bias, 5)
    assert "request b not recorded" in caplog.text
