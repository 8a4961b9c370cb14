"""Every command of the README's ``bash`` blocks runs as written (issue 13 item 10), and its Python
example too. Speed: ``paged run`` gets ``--max-tokens 4`` appended (a later flag wins), the lab
gets smaller limits; a ``paged serve`` line starts in the background on a free port and the
block's other lines (curl) run against it. Not run: ``.ci/setup`` (the CI's own job: the rest
of that line runs with this venv's ``paged``), the test-suite line, and the two-host torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NOT_RUN = {  # command prefix: why
    "bash .ci/setup && .venv/bin/python -m pytest": "the test suite itself (.ci/run)",
    "torchrun ": "two hosts; tests/test_tensor_parallel.py runs it over loopback",
}
FAST = [  # (command prefix, flags appended to keep the test fast)
    ("paged run", "--max-tokens 4"),
    ("paged lab calibrate", "--scale 0.02 --max-num-seqs 2 --max-model-len 128 --no-validate"),
    ("paged lab replay trace.jsonl --policy", "--max-requests 4"),
    ("paged lab replay", "--max-requests 40 --max-model-len 2048"),  # beyond the calibration above: it warns
]


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block: continuation lines joined, comments dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", "", block)
        commands = []
        for line in joined.splitlines():
            line = _strip_comment(line).strip()
            if line:
                commands.append(line)
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
                          text=True, timeout=timeout)  # fmt: skip
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


def run_block(commands: list[str], cwd: Path) -> list[str]:
    """Run one block's commands; returns the stdout of each."""
    env = _env(cwd)
    outputs = []
    server = None
    port = None
    try:
        for command in commands:
            if command.startswith("export "):
                name = command[len("export "):].split("=", 1)[0]
                env[name] = _bash(f'{command}; printf %s "${name}"', cwd, env).stdout
                continue
            prepared = _prepare(command)
            if prepared is None:
                continue
            if prepared.startswith("paged serve"):
                port = _free_port()
                log = cwd / f"server-{port}.log"  # a file, not a pipe nobody reads while it fills
                with open(log, "w") as log_file:
                    server = subprocess.Popen(["bash", "-c", f"exec {prepared} --port {port}"], cwd=cwd, env=env,
                                              stdout=log_file, stderr=subprocess.STDOUT)  # fmt: skip
                _wait_healthy(port, server, log)
                continue
            if port is not None:
                prepared = prepared.replace("localhost:8000", f"localhost:{port}")
            outputs.append(_bash(prepared, cwd, env).stdout)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    return outputs


def test_bash_blocks_parse_as_expected():
    blocks = bash_blocks((ROOT / "README.md").read_text())
    commands = [c for block in blocks for c in block]
    assert "bash .ci/setup && .venv/bin/paged run --chat \"What is the capital of France?\"" in commands
    assert any(c.startswith("curl -s localhost:8000/v1/chat/completions -H \"Authorization: Bearer $KEY\"") for c in commands)
    assert all("\\\n" not in c and not c.startswith("#") for c in commands)
    skipped = [c for c in commands if _prepare(c) is None]
    assert len(skipped) == 2, skipped  # the test-suite line and torchrun, nothing else


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory like a checkout's root for commands that write files (configs/ linked)."""
    path = tmp_path_factory.mktemp("readme")
    (path / "configs").symlink_to(ROOT / "configs")
    return path


BLOCKS = bash_blocks((ROOT / "README.md").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b[0].split()[0] + f"-{i}" for i, b in enumerate(BLOCKS)])
def test_readme_bash_block_runs(index, workdir):
    commands = BLOCKS[index]
    outputs = run_block(commands, workdir)
    for command, out in zip([c for c in commands if _prepare(c) and not c.startswith(("paged serve", "export"))], outputs):
        if command.startswith("curl"):
            doc = json.loads(out)
            assert doc.get("choices"), doc  # an answer, not an error document
        if re.search(r"--json(\s|$)", command) and command.startswith("paged run"):
            assert json.loads(out)["requests"]


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    example = next(b for b in blocks if "from paged import LLM" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=_env(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "The capital of France is Paris."  # the greedy chat answer
