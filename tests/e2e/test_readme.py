"""Every command of the README that a user would copy runs as written, and prints what the README
says it prints (issue 13 item 10, issue 23 item 8).

What runs, outside the plugin sections (SECTIONS_TESTED_ELSEWHERE, whose examples have tests of
their own):

- each ``bash`` block, command by command; a ``paged serve`` line starts in the background on a
  free port and the block's other lines (curl) run against it (a bare ``paged serve``, the
  command of ``readme_server`` below, runs against that one: one start for all of them);
- each ``python`` block, as a script; one that talks to ``127.0.0.1:8000`` gets a ``paged serve``
  of the default model (``readme_server``);
- each command in the text: a ``paged ...`` or ``python benchmarks/...`` in backticks, and each
  line of an indented block (INLINE). The bare names of commands (``paged run``) are not
  commands. Those with placeholders (``N``, ``NAME``, ``...``, ``[TRACE]``, ``<dir>``, ``a | b``)
  and the benchmarks run as ``--help``, and each flag the README gives them must be in that help:
  the benchmarks take minutes to hours, some a GPU or llama.cpp. Two run with small limits
  (BENCHMARK_LIMITS): ``scheduler_sim.py --policy srpt`` (300 requests) and the simulated
  ``policy_comparison.py`` (5% of each workload). ``paged bench serve`` load-tests
  ``readme_server`` with 4 requests; ``paged lab replay t.jsonl ...`` replays simulated (on the
  engine it takes minutes).

A ``# -> TEXT`` comment is what the README says a command prints: after a bash command, its
stdout contains TEXT; after a Python ``print(...)`` (on its line, or alone on the next), that
print's output is TEXT (with ``...`` at the end: starts with it).

Speed: ``paged run`` gets ``--max-tokens 8`` appended (a later flag wins), the lab and ``paged
bench serve`` smaller limits (FAST). Not run: ``.ci/setup`` (the CI's own job: the rest of that
line runs with this venv's ``paged``), the test-suite line, and the two-host torchrun.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tokenize
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import REPO_ROOT

ROOT = REPO_ROOT
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
SECTIONS_TESTED_ELSEWHERE = ("Plugins", "Writing a plugin", "Writing a model plugin", "Writing a policy")
NOT_RUN = {  # command prefix: why
    "bash .ci/setup && .venv/bin/python -m pytest": "the test suite itself (.ci/run)",
    "torchrun ": "two hosts; tests/core/engine/test_tensor_parallel.py and tests/e2e/test_nodes.py run them over "
                 "loopback",
    "paged serve --data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address 10.0.0.1":
        "node 0 of two hosts; tests/e2e/test_nodes.py runs the same flags over loopback",
    "paged serve --headless": "node 1 of two hosts; tests/e2e/test_nodes.py runs it over loopback",
}
FAST = [  # (command prefix, flags appended to keep the test fast); the first match wins
    ("paged run", "--max-tokens 8"),
    ("paged bench serve", "--num-prompts 4 --input-len 16 --output-len 4 --json"),
    ("paged lab calibrate", "--scale 0.02 --max-num-seqs 2 --max-model-len 128 --no-validate"),
    ("paged lab replay trace.jsonl --policy", "--max-requests 4 --no-plots"),  # the simulated replay above draws them
    ("paged lab replay t.jsonl", "--simulate const:0.01 --num-kv-blocks 1024 --no-plots"),  # on the engine: minutes
    ("paged lab replay", "--max-requests 40 --max-model-len 2048"),  # beyond the calibration above: it warns
]
COMMAND_NAMES = {"paged run", "paged serve", "paged lab", "paged lab replay"}  # named in prose, not run
BENCHMARK_LIMITS = {  # benchmarks cheap enough to run (the others run as --help): flags appended
    "python benchmarks/scheduler_sim.py --policy srpt": "--num-requests 300",
    "python benchmarks/policy_comparison.py": "--scale 0.05",
}
PLACEHOLDER = re.compile(r"\.\.\.|\[|<|(?<!\S)(N|NAME)(?!\S)| \| ")
SETUP = {  # inline command prefix: the command that makes what it reads
    "paged lab replay t.jsonl": "paged lab gen --workload multi-tenant --out t.jsonl",
}
INLINE_EXPECT = {  # inline command prefix: what its stdout contains (as the README describes it)
    "paged config": ["# what will run here", "device:", "attention_backend:", "dtype:"],
    "paged lab policies": ["fcfs", "priority", "srpt", "fair", "cache-aware", "slo"],
    "paged bench serve": ['"successful_requests": 4,', '"failed_requests": 0,'],
}


# --- reading the README ----------------------------------------------------------------------
class Command(NamedTuple):
    text: str
    expect: str | None  # its `# -> TEXT`


def readme_sections(text: str = README) -> list[tuple[str, str]]:
    """(heading, body) of each section but SECTIONS_TESTED_ELSEWHERE; a ``#`` line in a code block
    is no heading."""
    sections, heading, body, fenced = [], "", [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            sections.append((heading, "".join(body)))
            heading, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    sections.append((heading, "".join(body)))
    return [(h, b) for h, b in sections if h not in SECTIONS_TESTED_ELSEWHERE]


def code_blocks(language: str) -> list[str]:
    return [block for _, body in readme_sections()
            for block in re.findall(rf"^```{language}\n(.*?)^```", body, flags=re.S | re.M)]


def _expected(comment: str) -> str | None:
    match = re.match(r"#\s*->\s*(.+)", comment.strip())
    return match.group(1).strip() if match else None


def bash_blocks() -> list[list[Command]]:
    """The commands of each ```bash block: continuation lines joined, comments dropped."""
    out = []
    for block in code_blocks("bash"):
        commands = []
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            head = _strip_comment(line)
            if head.strip():
                commands.append(Command(head.strip(), _expected(line[len(head):])))
        out.append(commands)
    return out


def _strip_comment(line: str) -> str:
    """Drop a comment line, or a trailing `  # ...` that is outside quotes."""
    if line.lstrip().startswith("#"):
        return ""
    for match in re.finditer(r"\s#", line):
        head = line[: match.start()]
        try:
            shlex.split(head)
        except ValueError:  # inside quotes
            continue
        return head
    return line


def python_expectations(block: str) -> list[str | None]:
    """For each ``print(`` line of a block, in order: its `# -> TEXT` (on the line, or alone on the
    next line), else None."""
    tokens = tokenize.generate_tokens(io.StringIO(block).readline)
    comments = {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}
    lines = block.splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.startswith("print("):
            continue
        expect = _expected(comments.get(number, ""))
        if expect is None and number < len(lines) and lines[number].lstrip().startswith("#"):
            expect = _expected(comments[number + 1])
        out.append(expect)
    return out


def inline_commands() -> list[str]:
    """`paged ...` and `python benchmarks/...` in backticks in the text, and the `paged` / `python`
    lines of indented blocks; once each, in order."""
    found = []
    for _, body in readme_sections():
        text = re.sub(r"^```.*?^```", "", body, flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", text):
            span = " ".join(span.split())  # a span may wrap lines
            if re.match(r"paged [a-z]|python benchmarks/\w+\.py", span):
                found.append(span)
        for line in re.findall(r"^    ((?:paged|python) .*)$", text, flags=re.M):
            found.append(_strip_comment(line).strip())
    return list(dict.fromkeys(found))


def _help_command(command: str) -> str:
    """The program of a command (a benchmark, or `paged` and its subcommands), with --help."""
    words = command.split()
    if words[0] == "python":
        return f"python {words[1]} --help"
    program = []
    for word in words:
        if not re.fullmatch(r"[a-z][a-z-]*", word):
            break
        program.append(word)
    return " ".join(program) + " --help"


# --- running it ------------------------------------------------------------------------------
def _prepare(command: str) -> str | None:
    for prefix in NOT_RUN:
        if command.startswith(prefix):
            return None
    command = command.replace("bash .ci/setup && ", "").replace(".venv/bin/", "")
    for prefix, flags in FAST:
        if re.search(rf"(^|\| ){re.escape(prefix)}", command):
            return f"{command} {flags}"
    return command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGED_REQUIRE_MODEL"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _bash(command: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-c", f"set -eo pipefail; {command}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc


def _wait_healthy(port: int, server: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not become healthy: {log.read_text()[-3000:]}")


@contextlib.contextmanager
def background_server(command: str, cwd: Path, env: dict[str, str]):
    """Start a `paged serve ...` command on a free port; yields the port once /health is 200."""
    port = _free_port()
    log = cwd / f"server-{port}.log"  # a file, not a pipe nobody reads while it fills
    with open(log, "w") as log_file:
        server = subprocess.Popen(["bash", "-c", f"exec {command} --port {port}"], cwd=cwd, env=env,
                                  stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, server, log)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def _on_port(command: str, port: int | None) -> str:
    if port is None:
        return command
    return command.replace("localhost:8000", f"localhost:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def run_block(commands: list[Command], cwd: Path, shared_server=None) -> list[tuple[Command, str]]:
    """Run one bash block's commands; returns (command, stdout) of each that ran (servers and
    exports aside). ``shared_server()`` (the port of ``readme_server``) serves a block whose
    server is that one's command, ``paged serve`` with at most a ``--port``, in the same
    environment: one server start instead of one per block."""
    env = _env(cwd)
    outputs = []
    port = None
    with contextlib.ExitStack() as stack:  # the block's server, stopped at its end
        for command in commands:
            if command.text.startswith("export "):
                name = command.text[len("export "):].split("=", 1)[0]
                env[name] = _bash(f'{command.text}; printf %s "${name}"', cwd, env).stdout
                continue
            prepared = _prepare(command.text)
            if prepared is None:
                continue
            if prepared.startswith("paged serve"):
                same_as_shared = re.fullmatch(r"paged serve( --port \d+)?", prepared) and env == _env(cwd)
                if shared_server is not None and same_as_shared:
                    port = shared_server()
                else:
                    port = stack.enter_context(background_server(prepared, cwd, env))
                continue
            outputs.append((command, _bash(_on_port(prepared, port), cwd, env).stdout))
    return outputs


# Put before a block: every print() then ends with a separator line, so that what each print
# printed can be told apart.
PRINT_END = "\x1e"
PRINTS = 'import builtins, functools\nprint = functools.partial(builtins.print, end="\\n\\x1e\\n")\n'


def run_python_block(block: str, cwd: Path, port: int | None = None) -> list[str]:
    """Run a Python block as a script; returns what each of its print() calls printed."""
    script = cwd / "example.py"
    script.write_text(PRINTS + _on_port(block, port))
    proc = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=_env(cwd))
    assert proc.returncode == 0, f"{block}\n--- stderr\n{proc.stderr[-3000:]}"
    return [chunk.strip() for chunk in proc.stdout.split(PRINT_END)[:-1]]


# --- tests -----------------------------------------------------------------------------------
BLOCKS = bash_blocks()
PYTHON_BLOCKS = code_blocks("python")
INLINE = [c for c in inline_commands() if c not in COMMAND_NAMES]


def test_readme_parses_as_expected():
    commands = [c.text for block in BLOCKS for c in block]
    assert "bash .ci/setup && .venv/bin/paged run --chat \"What is the capital of France?\"" in commands
    assert any(c.startswith("curl -s localhost:8000/v1/chat/completions -H \"Authorization: Bearer $KEY\"") for c in commands)
    assert all("\\\n" not in c and not c.startswith("#") for c in commands)
    skipped = [c for c in commands if _prepare(c) is None]
    assert len(skipped) == 5, skipped  # the test-suite line, the two torchrun lines and the two nodes, nothing else
    expected = [c.expect for block in BLOCKS for c in block if c.expect]
    assert "The capital of France is Paris." in expected, expected
    # the Python blocks: LLM, embeddings offline, the structured output offline and through the official client
    assert len(PYTHON_BLOCKS) == 5 and any("OpenAI(base_url=" in b for b in PYTHON_BLOCKS)
    assert any("lora_request=[None, mine]" in b for b in PYTHON_BLOCKS)
    assert any('LLM(runner="pooling")' in b for b in PYTHON_BLOCKS)
    assert [python_expectations(b) for b in PYTHON_BLOCKS][0] == ["Paris. ...", None, "The capital of France is Paris."]
    # prose and indented blocks; a span that wraps lines is one command
    assert "paged run" in inline_commands() and "paged run" not in INLINE  # a name
    for command in ("paged bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 8",
                    "python benchmarks/policy_comparison.py", "python benchmarks/ttft.py", "paged config"):
        assert command in INLINE, INLINE
    assert not [c for c in INLINE if "--cost cost.json: a calibrated model" in c]  # its comment dropped


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory like a checkout's root for commands that write files (configs/ and benchmarks/
    linked)."""
    path = tmp_path_factory.mktemp("readme")
    (path / "configs").symlink_to(ROOT / "configs")
    (path / "benchmarks").symlink_to(ROOT / "benchmarks")
    return path


@pytest.fixture(scope="module")
def readme_server(workdir):
    """`paged serve` of the default model, as in the README's "Serving"; yields its port."""
    with background_server("paged serve", workdir, _env(workdir)) as port:
        yield port


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b[0].text.split()[0] + f"-{i}" for i, b in enumerate(BLOCKS)])
def test_readme_bash_block_runs(index, workdir, request):
    for command, out in run_block(BLOCKS[index], workdir, lambda: request.getfixturevalue("readme_server")):
        if command.text.startswith("curl"):
            # an answer (choices, embeddings, scores, results, a response's output, tokens or text),
            # not an error document (a response carries "error": null)
            answer = json.loads(out)
            assert answer.get("error") is None, out
            assert any(answer.get(k) for k in ("choices", "data", "results", "output", "tokens", "prompt",
                                               "message")), out  # "message": /v1/load_lora_adapter's
        if re.search(r"--json(\s|$)", command.text) and command.text.startswith("paged run"):
            assert json.loads(out)["requests"]
        if command.expect is not None:
            assert command.expect in out, f"{command.text}\nprinted:\n{out[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python_block_runs(index, workdir, request):
    block = PYTHON_BLOCKS[index]
    port = request.getfixturevalue("readme_server") if "127.0.0.1:8000" in block else None
    printed = run_python_block(block, workdir, port)
    expected = python_expectations(block)
    assert len(printed) == len(expected), (printed, expected)
    for out, expect in zip(printed, expected):
        if expect is not None and expect.endswith("..."):
            assert out.startswith(expect[:-3].rstrip()), (out, expect)
        elif expect is not None:
            assert out == expect


@pytest.mark.slow
@pytest.mark.parametrize("command", INLINE, ids=[c[:60] for c in INLINE])
def test_readme_inline_command_runs(command, workdir, request):
    env = _env(workdir)
    if PLACEHOLDER.search(command) or (command.startswith("python benchmarks/") and command not in BENCHMARK_LIMITS):
        out = _bash(_help_command(command), workdir, env).stdout
        flags = re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", command)
        assert [f for f in flags if f not in out] == [], out
        return
    for prefix, setup in SETUP.items():
        if command.startswith(prefix):
            _bash(setup, workdir, env)
    port = request.getfixturevalue("readme_server") if ":8000" in command else None
    prepared = _prepare(command)
    if command in BENCHMARK_LIMITS:
        prepared = f"{command} {BENCHMARK_LIMITS[command]}"
    out = _bash(_on_port(prepared, port), workdir, env).stdout
    for prefix, texts in INLINE_EXPECT.items():
        if command.startswith(prefix):
            assert [t for t in texts if t not in out] == [], out
