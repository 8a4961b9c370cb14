"""A real `paged serve` subprocess on a loopback port for tests, and small waiting helpers."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

API_KEY = "sk-paged-test"

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (the engine cores' RPC sockets: ``--data-parallel-rpc-port``
    and the next one), below the kernel's ephemeral range: ``free_port`` hands out ports in that
    range, where any outgoing connection of another test may take p + 1 before the server binds it
    ("Address already in use" in a CI run)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, max(10002, low - 2))
        if _bindable(port) and _bindable(port + 1):
            return port
    raise AssertionError("no two consecutive free ports below the ephemeral range")


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


_http_client = None
_http_client_lock = threading.Lock()


def http():
    """This process's one ``httpx.Client``. A module-level ``httpx.get`` builds a client per call,
    and each client an SSL context from the CA bundle (~30 ms of CPU, even for plain http): a
    server start polled /health 30-60 times. No connection is kept alive, so a request never
    meets a socket of a server that an earlier test stopped."""
    global _http_client
    with _http_client_lock:
        if _http_client is None:
            import httpx

            _http_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        return _http_client


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, key: str | None = API_KEY, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return http().get(self.url + path, timeout=30, headers={**headers, **kw.pop("headers", {})}, **kw)

    def post(self, path: str, body, key: str | None = API_KEY, timeout=120):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return http().post(self.url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                           timeout=timeout)

    def debug(self, stats: bool = False) -> dict:
        """/debug/engine. ``stats``: the caller reads the cores' stats (``core``, ``cores``), so
        ask again while the cores did not send them in time (``stats_error``: a loaded machine)."""
        if not stats:
            return self.get("/debug/engine").json()
        return wait_for(lambda: (info := self.get("/debug/engine").json()).get("stats_error") is None and info,
                        120, "/debug/engine with the cores' stats")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.get("/metrics").text.splitlines():
            m = re.match(r"^(paged:[a-zA-Z0-9_:]+)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


@contextmanager
def serve(args: list[str], tmp: Path, port: int, env: dict[str, str] | None = None):
    log = tmp / f"serve-{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "paged.core.cli", "serve", *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    try:
        import httpx

        def healthy():
            if proc.poll() is not None:
                raise AssertionError(f"paged serve exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                return http().get(server.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 600, "/health to return 200", interval=0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def watch_health(server, interval: float = 0.02):
    """Poll /health from a thread (one kept-alive connection) while the block runs; yields the
    list of its latencies in seconds, and checks every answer was a 200."""
    import httpx

    latencies: list[float] = []
    statuses: list[int] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                start = time.perf_counter()
                statuses.append(client.get("/health").status_code)
                latencies.append(time.perf_counter() - start)
                stop.wait(interval)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(60)
    assert latencies and set(statuses) == {200}, statuses


def assert_health_kept_answering(latencies: list[float], stall_s: float) -> None:
    """``/health`` was answered throughout: most polls at once, and none held up for anything like
    ``stall_s``, the stall the event loop would show if the work under test ran on it. Bounds
    relative to that stall, not a fixed latency: a loaded 2-core machine (a second test process,
    the engine core, a compile worker) delays single polls by tens to hundreds of ms."""
    ordered = sorted(latencies)
    median, worst = ordered[len(ordered) // 2], ordered[-1]
    assert median < 0.1 and worst < stall_s / 2, f"median {median:.3f} s, slowest {ordered[-5:]}"


@contextmanager
def serve_default_model(default_model_dir: str, tmp: Path, *extra: str):
    """``paged serve`` of the default model as the HF-reference tests need it (float32, the torch
    backend, on the CPU; API_KEY; -q) on a free port, with ``extra`` flags."""
    port = free_port()
    args = ["--model", default_model_dir, "--device", "cpu", "--dtype", "float32", "--attention", "torch",
            "--port", str(port), "--api-key", API_KEY, "-q", *extra]
    with serve(args, tmp, port) as server:
        yield server
