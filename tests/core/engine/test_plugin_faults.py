"""Naming the plugin whose code raised (paged.core.engine.plugin_faults.describe)."""

from __future__ import annotations

from paged.core.engine.plugin_faults import PluginCode, describe


def _raise_in(path: str, name: str) -> BaseException:
    """An exception whose innermost traceback frame is function ``name`` of file ``path``."""
    code = compile(f"def {name}():\n    raise RuntimeError('boom')\n", path, "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope[name]()
    except RuntimeError as e:
        return e
    raise AssertionError("did not raise")


def test_the_file_that_defines_a_plugin_names_it_before_a_package_two_share(tmp_path):
    package = str(tmp_path / "shared_plugins") + "/"
    backend = PluginCode("attention backend", "gather", "shared", frozenset({package + "backend.py"}), (package,))
    method = PluginCode("quantization method", "faulty-quant", "shared", frozenset({package + "faulty.py"}), (package,))
    error = _raise_in(package + "faulty.py", "linear")
    # the backend comes first among the suspects and owns the whole package, yet the method's file decides
    assert describe(error, [backend, method]) == (
        "quantization method 'faulty-quant' (plugin 'shared') raised in linear: RuntimeError: boom")
    # a file of the package that no suspect defines: the first suspect owning the package
    assert describe(_raise_in(package + "util.py", "helper"), [backend, method]).startswith(
        "attention backend 'gather' (plugin 'shared') raised in helper")


def test_no_suspect_frame_names_the_caller_or_the_engine(tmp_path):
    policy = PluginCode("policy", "fcfs", None, frozenset({str(tmp_path / "p.py")}))
    error = _raise_in(str(tmp_path / "elsewhere.py"), "f")
    assert describe(error, [policy], policy, "sort_key") == "policy 'fcfs' raised in sort_key: RuntimeError: boom"
    assert describe(error, [policy]) == "the engine failed: RuntimeError: boom"
