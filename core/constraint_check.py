"""The front-end's check of a structured-output constraint, before its request is queued.

Two stages, both bounded:

- ``check_bounds`` (on the caller's thread, cost bounded by the limits themselves): a JSON
  schema nests at most ``structured_output.max_schema_depth`` objects/arrays deep, and no
  constraint is over ``structured_output.max_constraint_bytes``;
- the compile check (``ConstraintValidator.check`` / ``check_async``): the constraint compiled as
  the engine core would compile it, by the configured backend built on the model's tokenizer,
  in a worker process (a compile cannot be interrupted in a thread; a process can be killed),
  within ``structured_output.constraint_check_timeout_s``. The worker refuses what the backend
  rejects, what it would only warn about (xgrammar's C++ warnings say where it ignores part of
  a constraint), and what it cannot use although it compiled
  (``StructuredOutputBackend.check_compiled``: e.g. no output satisfies it).

Verdicts are cached by a digest of ``params.cache_key()``, good and bad alike: a constraint seen
before costs a dictionary lookup. Workers are shared by the engines of one process that use the
same backend settings and tokenizer, started on the first check (a killed one is replaced in the
background), and ended at exit or when their parent is gone. The offline ``LLM`` gets the same
checks (``ConstraintValidator.__call__`` with the model, outside an event loop); the server
awaits them from a thread, so that its event loop never waits. Messages are JSON lines on
stdin/stdout, never pickle: first ``{"config": <EngineConfig JSON>, "model": {...}}``, answered
``{"ready": true}`` or ``{"failed": message}``; then one ``{"constraint": {field: value}}`` at a
time, answered ``{"error": null | message}``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import hashlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from paged.core.errors import InvalidRequestError, PagedError
from paged.core.structured_output import StructuredOutputParams

WORKER_START_TIMEOUT_S = 300.0  # loading the tokenizer and the backend's tables, on a busy machine
VERDICT_CACHE_SIZE = 4096


# --- bounded checks -----------------------------------------------------------------------------
def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_bounds(params: StructuredOutputParams, max_depth: int, max_bytes: int) -> None:
    """Raise InvalidRequestError if a JSON schema nests deeper than ``max_depth`` objects and
    arrays or any constraint is over ``max_bytes`` (a schema's size as compact JSON, estimated
    without escapes). Stops as soon as a limit is passed, so its cost is bounded by the limits."""
    kind = params.kind
    size_error = (f"structured_output.{kind}: larger than {max_bytes} bytes (structured_output.max_constraint_bytes); "
                  f"a constraint of at most {max_bytes} bytes is accepted")
    if kind in ("regex", "grammar"):
        if len(params.value) > max_bytes or _utf8_len(params.value) > max_bytes:
            raise InvalidRequestError(size_error)
    elif kind == "choice":
        size = 0
        for choice in params.choice:
            size += _utf8_len(choice) + 1
            if size > max_bytes:
                raise InvalidRequestError(size_error)
    elif kind == "json_schema":
        size = 0
        stack: list[tuple[Any, int]] = [(params.json_schema, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, (dict, list)):
                if depth > max_depth:
                    raise InvalidRequestError(
                        f"structured_output.json_schema: nested deeper than {max_depth} objects and arrays "
                        f"(structured_output.max_schema_depth); a schema nested at most {max_depth} deep is "
                        f"accepted (use $defs and $ref to repeat a part)")
                size += 1
                for key, value in node.items() if isinstance(node, dict) else enumerate(node):
                    size += 1 if isinstance(node, list) else _utf8_len(str(key)) + 4
                    if size > max_bytes:  # before a huge object is walked to its end
                        raise InvalidRequestError(size_error)
                    stack.append((value, depth + 1))
            elif isinstance(node, str):
                size += _utf8_len(node) + 2
            elif isinstance(node, int) and not isinstance(node, bool):
                size += node.bit_length() * 3 // 10 + 2  # about its digits, without converting it
            else:
                size += 5
            if size > max_bytes:
                raise InvalidRequestError(size_error)


# --- the validator the front-end calls ---------------------------------------------------------
class ConstraintValidator:
    """``validator(params)``: the bounded checks; ``validator(params, model_info)``: also a
    verdict already reached, else the backend's own check (``spec.validate``, no tokenizer) and,
    outside a running event loop, the compile check. In a loop the caller awaits ``check_async``
    first (the server does), so that nothing here blocks it. Raises InvalidRequestError naming
    ``structured_output.<field>``.

    ``spec`` and ``options`` (``resolve_structured_output``'s) may be left out: the API server's
    front-end does not load the plugins (they import torch; its engine core checks the backend
    before any weight loads). Outside an event loop they are then resolved on first use; in one
    (``AsyncLLM``) they are not, as that would stall the loop for a second: a constraint
    without a verdict gets only the bounded checks there, and the caller's ``check_async``
    (which the server awaits first) runs the backend's own check in the worker."""

    def __init__(self, config, spec=None, options=None) -> None:
        so = config.structured_output
        self.config = config
        self._backend: tuple[Any, Any] | None = None if spec is None else (spec, options)  # set once, whole
        self.max_depth = so.max_schema_depth
        self.max_bytes = so.max_constraint_bytes

    def backend(self) -> tuple[Any, Any]:
        """(spec, options) of the configured backend, resolved through the plugins on first use."""
        if self._backend is None:
            from paged.core.config import resolve_structured_output

            self._backend = resolve_structured_output(self.config)
        return self._backend

    @property
    def spec(self) -> Any:
        return self.backend()[0]

    @property
    def options(self) -> Any:
        return self.backend()[1]

    def __call__(self, params: StructuredOutputParams, model_info=None) -> None:
        check_bounds(params, self.max_depth, self.max_bytes)
        if model_info is None:
            return
        checker = _checker_for(self.config, model_info)
        known, error = checker.verdict(params)
        if not known:
            in_loop = _in_event_loop()
            if self._backend is not None or not in_loop:
                spec, options = self.backend()
                try:  # a malformed constraint is refused here, without starting a worker
                    spec.validate(params, options)
                except ValueError as e:
                    raise InvalidRequestError(str(e)) from None
            if not in_loop:
                error = checker.future(params).result()
        if error:
            raise InvalidRequestError(error)

    def check(self, params: StructuredOutputParams, model_info) -> None:
        """Both checks; blocks until the worker answers (at most the time limit, plus the
        worker's start on first use)."""
        check_bounds(params, self.max_depth, self.max_bytes)
        error = _checker_for(self.config, model_info).future(params).result()
        if error:
            raise InvalidRequestError(error)

    async def check_async(self, params: StructuredOutputParams, model_info) -> None:
        """``check`` without blocking the event loop (the worker is driven from a thread)."""
        check_bounds(params, self.max_depth, self.max_bytes)
        checker = _checker_for(self.config, model_info)
        known, error = checker.verdict(params)
        if not known:
            # shielded: a client that goes away must not cancel the check others may share
            error = await asyncio.shield(asyncio.wrap_future(checker.future(params)))
        if error:
            raise InvalidRequestError(error)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# --- the compile check: workers and verdicts ---------------------------------------------------
_checkers: dict[str, "_CompileChecker"] = {}
_checkers_lock = threading.Lock()


def _checker_for(config, model_info) -> "_CompileChecker":
    """The process's checker for this backend configuration and tokenizer (one per key)."""
    model = {"tokenizer_dir": model_info.tokenizer_dir or model_info.model_dir,
             "vocab_size": model_info.vocab_size, "eos_token_ids": list(model_info.eos_token_ids)}
    key = json.dumps([config.structured_output.model_dump(mode="json"), model], sort_keys=True)
    with _checkers_lock:
        checker = _checkers.get(key)
        if checker is None:
            checker = _checkers[key] = _CompileChecker(config, model)
        return checker


class _CompileChecker:
    def __init__(self, config, model: dict[str, Any]) -> None:
        from paged.core.config import for_child_process

        payload, self.env = for_child_process(config)
        # the plugins this process sees, as the engine core in it sees them
        self.env.update({k: os.environ[k] for k in ("PAGED_PLUGINS", "PAGED_DISABLE_PLUGINS") if k in os.environ})
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.setup = (json.dumps({"config": json.loads(payload), "model": model}) + "\n").encode()
        self.timeout_s = config.structured_output.constraint_check_timeout_s
        self.max_workers = config.structured_output.constraint_check_workers
        self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="paged-constraint-check")
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()  # digest -> error message or None
        self._pending: dict[str, Future] = {}
        self._workers = threading.Condition()  # guards the two below
        self._idle: list[_Worker] = []
        self._num_workers = 0  # idle, busy or starting

    @staticmethod
    def _digest(params: StructuredOutputParams) -> str:
        return hashlib.sha256(params.cache_key().encode("utf-8", "surrogatepass")).hexdigest()

    def verdict(self, params: StructuredOutputParams) -> tuple[bool, str | None]:
        """(known, error message or None)."""
        key = self._digest(params)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return True, self._verdicts[key]
        return False, None

    def future(self, params: StructuredOutputParams) -> Future:
        """A future of the error message (None: fine); one check per constraint at a time."""
        key = self._digest(params)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                done: Future = Future()
                done.set_result(self._verdicts[key])
                return done
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = self._pool.submit(self._run, key, params)
            return future

    def _run(self, key: str, params: StructuredOutputParams) -> str | None:
        try:
            error = self._compile(params)
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)  # not a verdict (the worker did not start): not cached
            raise
        with self._lock:
            self._pending.pop(key, None)
            self._verdicts[key] = error
            while len(self._verdicts) > VERDICT_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return error

    def _compile(self, params: StructuredOutputParams) -> str | None:
        worker = self._take_worker()
        kind = params.kind
        try:
            reply = worker.ask({"constraint": {kind: params.value}}, self.timeout_s)
        except TimeoutError:
            self._replace(worker)
            return (f"structured_output.{kind}: not compiled within {self.timeout_s:g} s "
                    f"(structured_output.constraint_check_timeout_s); a smaller or simpler constraint is accepted")
        except EOFError:
            code = self._replace(worker)
            return f"structured_output.{kind}: the grammar backend crashed compiling it (exit code {code})"
        with self._workers:
            self._idle.append(worker)
            self._workers.notify()
        return reply.get("error")

    def _take_worker(self) -> "_Worker":
        """An idle worker, else a new one while there are fewer than ``max_workers``, else the
        next one given back (a replacement may be starting)."""
        with self._workers:
            while not self._idle and self._num_workers >= self.max_workers:
                self._workers.wait()
            if self._idle:
                return self._idle.pop()
            self._num_workers += 1
        return self._start_worker()

    def _start_worker(self) -> "_Worker":
        try:
            return _Worker(self.setup, self.env)
        except BaseException:
            with self._workers:
                self._num_workers -= 1
                self._workers.notify()
            raise

    def _replace(self, worker: "_Worker") -> int | None:
        """Kill a worker (its exit code) and start its replacement in the background, so that
        the next check does not wait for a start."""
        code = worker.kill()

        def start() -> None:
            with contextlib.suppress(Exception):  # a failed start is reported by the next check's own
                new = self._start_worker()
                with self._workers:
                    self._idle.append(new)
                    self._workers.notify()

        threading.Thread(target=start, name="paged-constraint-check-start", daemon=True).start()
        return code


_live_workers: set["_Worker"] = set()


class _Worker:
    """One worker process, driven by one thread at a time."""

    def __init__(self, setup: bytes, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "paged.core.constraint_check", "--parent-pid", str(os.getpid())]
        # its own session, like the engine core: a terminal's Ctrl-C reaches the parent only
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
                                     start_new_session=True)
        _live_workers.add(self)
        try:
            reply = self._exchange(setup, WORKER_START_TIMEOUT_S)
        except (TimeoutError, EOFError) as e:
            code = self.kill()
            raise PagedError(f"the structured-output check's worker did not start "
                             f"({'timed out' if isinstance(e, TimeoutError) else f'exit code {code}'})") from None
        if not reply.get("ready"):
            self.kill()
            raise PagedError(f"the structured-output check's worker failed to start: {reply.get('failed')}")

    def ask(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self._exchange((json.dumps(message) + "\n").encode(), timeout)

    def _exchange(self, line: bytes, timeout: float) -> dict[str, Any]:
        """Send one line, read one back; TimeoutError past ``timeout``, EOFError if it died."""
        deadline = time.monotonic() + timeout
        view = memoryview(line)
        try:
            while view:  # the worker reads while idle: a long line does not block for long
                view = view[os.write(self.proc.stdin.fileno(), view):]
        except OSError:
            raise EOFError from None
        fd, reply = self.proc.stdout.fileno(), b""
        poller = select.poll()  # not select.select: a busy server's descriptors pass FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while not reply.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            reply += chunk
        return json.loads(reply)

    def kill(self) -> int | None:
        """End the process (at once); its exit code."""
        _live_workers.discard(self)
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        return code


@atexit.register
def _kill_workers() -> None:
    for worker in list(_live_workers):
        worker.kill()


# --- inside the worker -------------------------------------------------------------------------
# xgrammar's C++ log lines: "[time] path/file.cc:123: Warning: <what it ignores>"
_BACKEND_WARNING = re.compile(r"\.(?:cc|cpp|h):\d+: Warning: (.*)")


@contextlib.contextmanager
def _captured_stderr(lines: list[str]):
    """Collect what is written to file descriptor 2 (C++ code included) into ``lines``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines += capture.read().decode("utf-8", "replace").splitlines()


def _check_one(spec, options, backend, model: dict[str, Any], params: StructuredOutputParams) -> str | None:
    kind = params.kind
    printed: list[str] = []
    try:
        with _captured_stderr(printed):
            spec.validate(params, options)
            compiled = backend.compile(params)
    except ValueError as e:
        return str(e)
    except Exception as e:
        return f"structured_output.{kind}: {spec.name} cannot compile it: {type(e).__name__}: {e}"
    warnings = [m.group(1) for m in map(_BACKEND_WARNING.search, printed) if m]
    if warnings:
        return (f"structured_output.{kind}: {spec.name} would ignore part of it ({warnings[0]}); "
                f"rewrite it without that")
    try:
        problem = backend.check_compiled(compiled, model["vocab_size"], model["eos_token_ids"])
    except Exception as e:  # the search could not tell; the engine core will report a failing plugin
        print(f"paged: {spec.name}'s check_compiled failed: {type(e).__name__}: {e}", file=sys.stderr)
        problem = None
    if problem:
        return f"structured_output.{kind}: {spec.name} cannot use it: {problem}"
    return None


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged.core.constraint_check")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the replies
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    setup = json.loads(sys.stdin.readline())
    try:
        from paged.core.config import EngineConfig, resolve_structured_output
        from paged.core.loading.tokenizer import load_tokenizer

        spec, options = resolve_structured_output(EngineConfig(**setup["config"]))
        model = setup["model"]
        tokenizer = load_tokenizer(model["tokenizer_dir"])
        backend = spec.factory(tokenizer, model["vocab_size"], model["eos_token_ids"], options)
        # the first compile builds a backend's lazy tables (llguidance: ~2 s): not a request's time
        _check_one(spec, options, backend, model, StructuredOutputParams(json_object=True))
    except Exception as e:
        reply({"failed": f"{type(e).__name__}: {e}"})
        return 1
    reply({"ready": True})
    for line in sys.stdin:
        try:
            params = StructuredOutputParams(**json.loads(line)["constraint"])
        except InvalidRequestError as e:
            reply({"error": str(e)})
            continue
        reply({"error": _check_one(spec, options, backend, model, params)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
