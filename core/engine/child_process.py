"""Starting a paged child process (an engine core, a tensor-parallel rank) and, inside it,
reading its config and noticing when its parent is gone. One protocol for both: the command is
``python -m MODULE ARGS --parent-pid PID``, the whole ``EngineConfig`` arrives as JSON on stdin
(``for_child_process``: never pickled, no ``PAGED_*`` variables that would override it), and
the child runs in its own session (a terminal's Ctrl-C reaches the parent, which stops it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from paged.core.config import EngineConfig, for_child_process


def spawn_child(module: str, args: list[str], config: EngineConfig, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m module args --parent-pid <this pid>`` with ``config`` on its stdin;
    ``env`` adds to (and overrides) the inherited environment."""
    payload, child_env = for_child_process(config)
    child_env.update(env or {})
    cmd = [sys.executable, "-m", module, *args, "--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=child_env, start_new_session=True)
    proc.stdin.write(payload)
    proc.stdin.close()
    return proc


def read_config_from_stdin() -> EngineConfig:
    """In the child: the config its parent wrote to stdin."""
    return EngineConfig(**json.loads(sys.stdin.read()))


def is_orphaned(parent_pid: int) -> bool:
    """The parent that started this process is gone (it was re-parented)."""
    return os.getppid() != parent_pid
