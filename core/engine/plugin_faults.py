"""Plugin code that raises while the engine serves: who raised, in which method, and what follows.

The engine calls plugin code on every step (the policy's decisions, the model, the attention
backend, the quantized linears, the grammar matchers). An exception there is *contained*:

- **per request** (the request ends with ``finish_reason == "error"`` and the message; the engine
  keeps serving the others): the policy's ``sort_key`` or ``admit`` for one request, and a
  structured-output matcher (``fill_bitmask``, ``accept_token``) or compilation for one request.
- **fatal** (the engine stops with the message; every request in flight ends with it): the model
  (``forward``, ``compute_logits``), the attention backend, a quantization method's kernels
  (the step's KV writes may be half done, and the prefix cache would keep them), and the policy's
  ``select_victim``, ``split_budget``, ``on_step`` or ``waiting_group`` (its state may be corrupt).

The message names the kind, the name and the plugin that registered it, the method that raised
and the exception: ``policy 'sjf' (plugin 'my_policies') raised in sort_key: KeyError: 3``. The
method is found by walking the traceback to the innermost frame in the plugin's own code. Each
distinct failure's traceback is logged once.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger("paged")

_CORE_ROOT = str(Path(__file__).resolve().parent.parent) + "/"  # paged.core: the engine and its contracts
_PAGED_ROOT = str(Path(__file__).resolve().parent.parent.parent) + "/"  # the ``paged`` package


@dataclass(frozen=True)
class PluginCode:
    """Where one selected plugin's code lives, to recognise its frames in a traceback."""

    kind: str  # "policy" | "attention backend" | "model" | "quantization method" | "structured-output backend"
    name: str  # the name it is registered (and selected) under
    plugin: str | None  # the plugin (entry-point name) that registered it; None: not known here
    files: frozenset[str]  # source files of its classes and functions
    packages: tuple[str, ...] = ()  # a third-party plugin's whole package directory

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name!r}" + (f" (plugin {self.plugin!r})" if self.plugin else "")

    def owns(self, filename: str) -> bool:
        return filename in self.files or any(filename.startswith(p) for p in self.packages)


def _source_file(obj: Any) -> str | None:
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if path else None


def plugin_code(kind: str, name: str, plugin: str | None, *implementations: Any) -> PluginCode:
    """``implementations``: the spec's factory and what it built (classes, instances or
    functions). Every class in their MRO counts, except paged's own contract bases (a policy's
    ``BasePolicy``); a plugin outside paged's package counts as a whole (its package directory)."""
    files: set[str] = set()
    packages: set[str] = set()
    for impl in implementations:
        if impl is None:
            continue
        if isinstance(impl, type):
            owners = impl.__mro__
        elif hasattr(impl, "__code__") or hasattr(impl, "__func__"):  # a function or a bound method
            owners = (getattr(impl, "__func__", impl),)
        else:  # an instance: its class and bases
            owners = type(impl).__mro__
        home = (getattr(owners[0], "__module__", None) or "").split(".")[0]
        for owner in owners:
            path = _source_file(owner)
            if path is None or path.startswith(_CORE_ROOT):  # builtins, paged.core's contract bases
                continue
            if not path.startswith(_PAGED_ROOT) and owner.__module__.split(".")[0] != home:
                continue  # a base from a library (torch.nn.Module): not the plugin's code
            files.add(path)
            top = sys.modules.get(owner.__module__.split(".")[0])
            top_file = getattr(top, "__file__", None)
            if not path.startswith(_PAGED_ROOT) and top_file and Path(top_file).name == "__init__.py":
                packages.add(str(Path(top_file).resolve().parent) + "/")  # a third-party package: all of it
    return PluginCode(kind, name, plugin, frozenset(files), tuple(sorted(packages)))


def describe(error: BaseException, suspects: Iterable[PluginCode], caller: PluginCode | None = None,
             method: str | None = None) -> str:
    """One line naming who raised: the innermost traceback frame in a suspect's code (its
    method's name), else ``caller``'s ``method`` when the engine called it directly, else the
    engine itself."""
    suspects = [s for s in suspects if s is not None]
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        filename = str(Path(frame.filename).resolve()) if frame.filename else ""
        # A file that defines a suspect's code names it before a package several suspects share
        # (one distribution can register a policy, a backend and a method from its modules).
        owner = next((s for s in suspects if filename in s.files), None) or next(
            (s for s in suspects if s.owns(filename)), None)
        if owner is not None:
            return f"{owner.label} raised in {frame.name}: {_exception(error)}"
    if caller is not None and method is not None:
        return f"{caller.label} raised in {method}: {_exception(error)}"
    return f"the engine failed: {_exception(error)}"


def _exception(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_fault(message: str, error: BaseException, *, request_id: str | None = None) -> None:
    """Log a contained failure: its traceback the first time this message is seen, one line after."""
    with _logged_lock:
        first = message not in _logged
        if first and len(_logged) < 1024:
            _logged.add(message)
    where = f"request {request_id}: " if request_id else ""
    if first:
        logger.error("%s%s", where, message, exc_info=(type(error), error, error.__traceback__))
    else:
        logger.error("%s%s (traceback logged before)", where, message)
