"""The plugin system: discovery, listing, broken plugins, conflicts, allow/deny lists, options."""

import importlib.metadata as md
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paged.core.config import load_config, resolve_plugins
from paged.core.errors import ConfigError, PluginError
from paged.core.registry import get_registry, load_plugins

FIXTURE = Path(__file__).parent / "fixtures" / "paged-example-plugin"


def _module_dir(tmp_path: Path, monkeypatch, files: dict[str, str]) -> None:
    for name, source in files.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


def _eps(*pairs):
    return [md.EntryPoint(name, value, "paged") for name, value in pairs]


GOOD = """
from paged.core.hookspecs import PolicySpec, hookimpl
from paged.core.policy import BasePolicy

class Lifo(BasePolicy):
    name = "lifo"
    def sort_key(self, request):
        return (-request.arrival_time,)

@hookimpl
def register_policies():
    return [PolicySpec("lifo", Lifo)]
"""


def test_bundled_plugins_register_through_the_entry_point_group():
    registry = get_registry()
    by_name = {p.name: p for p in registry.plugins}
    assert by_name["policies"].distribution == "paged"
    assert by_name["policies"].version
    assert by_name["policies"].provides["policies"] == ["fcfs", "priority", "srpt", "fair", "cache-aware", "slo"]
    assert "torch" in registry.attention_backends
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM"} <= set(registry.models)
    assert all(p.status == "ok" for p in registry.plugins), [p.to_dict() for p in registry.plugins]


def test_a_plugin_that_fails_to_import_warns_and_the_rest_still_work(tmp_path, monkeypatch, caplog):
    _module_dir(tmp_path, monkeypatch, {"good_plugin": GOOD, "broken_plugin": "raise RuntimeError('boom at import')"})
    with caplog.at_level(logging.WARNING, logger="paged"):
        registry = load_plugins(_eps(("good", "good_plugin"), ("broken", "broken_plugin")), allow=None, deny=set())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken" in warnings[0] and "boom at import" in warnings[0]
    assert "lifo" in registry.policies
    info = {p.name: p for p in registry.plugins}
    assert info["broken"].status == "failed" and "boom at import" in info["broken"].error
    with pytest.raises(ConfigError) as e:
        registry.policy("broken-thing")
    assert "broken" in str(e.value) and "boom at import" in str(e.value)


def test_a_plugin_whose_hook_raises_is_marked_failed(tmp_path, monkeypatch, caplog):
    raising = """
    from paged.core.hookspecs import hookimpl
    @hookimpl
    def register_policies():
        raise ValueError("hook exploded")
    """
    _module_dir(tmp_path, monkeypatch, {"good_plugin": GOOD, "raising_plugin": raising})
    with caplog.at_level(logging.WARNING, logger="paged"):
        registry = load_plugins(_eps(("good", "good_plugin"), ("raising", "raising_plugin")), allow=None, deny=set())
    info = {p.name: p for p in registry.plugins}
    assert info["raising"].status == "failed" and "hook exploded" in info["raising"].error
    assert info["good"].status == "ok" and "lifo" in registry.policies
    assert any("hook exploded" in r.getMessage() for r in caplog.records)


def test_two_plugins_with_the_same_name_is_an_error_naming_both(tmp_path, monkeypatch):
    _module_dir(tmp_path, monkeypatch, {"first_plugin": GOOD, "second_plugin": GOOD})
    with pytest.raises(PluginError) as e:
        load_plugins(_eps(("first", "first_plugin"), ("second", "second_plugin")), allow=None, deny=set())
    assert "'first'" in str(e.value) and "'second'" in str(e.value) and "lifo" in str(e.value)


def test_allow_and_deny_lists(tmp_path, monkeypatch):
    _module_dir(tmp_path, monkeypatch, {"good_plugin": GOOD})
    eps = _eps(("good", "good_plugin"), ("policies", "paged.plugins.policies"))
    registry = load_plugins(eps, allow={"policies"}, deny=set())
    assert set(registry.policies) == {"fcfs", "priority", "srpt", "fair", "cache-aware", "slo"}
    assert {p.name: p.status for p in registry.plugins}["good"] == "disabled"
    registry = load_plugins(eps, allow=None, deny={"policies"})
    assert set(registry.policies) == {"lifo"}


def test_env_vars_restrict_the_process_registry(monkeypatch):
    monkeypatch.setenv("PAGED_DISABLE_PLUGINS", "policies")
    try:
        registry = get_registry()
        assert "fcfs" not in registry.policies and "torch" in registry.attention_backends
        with pytest.raises(ConfigError, match="scheduler.policy: unknown value 'fcfs'"):
            resolve_plugins(load_config(), registry)
        monkeypatch.setenv("PAGED_PLUGINS", "attention")
        monkeypatch.delenv("PAGED_DISABLE_PLUGINS")
        assert set(get_registry().policies) == set()
    finally:
        monkeypatch.delenv("PAGED_PLUGINS", raising=False)
        monkeypatch.delenv("PAGED_DISABLE_PLUGINS", raising=False)
        get_registry()


def test_policy_options_are_typed_and_validated_per_field():
    resolved = resolve_plugins(load_config(overrides={"scheduler": {"policy": "priority", "policy_options": {"aging_s": "2.5"}}}))
    assert resolved.policy_options.aging_s == 2.5
    with pytest.raises(ConfigError) as e:
        resolve_plugins(load_config(overrides={"scheduler": {"policy": "priority", "policy_options": {"aging_s": -1}}}))
    assert "scheduler.policy_options.aging_s" in str(e.value) and "-1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve_plugins(load_config(overrides={"scheduler": {"policy": "priority", "policy_options": {"agin_s": 1}}}))
    assert "scheduler.policy_options.agin_s: unknown setting" in str(e.value)
    with pytest.raises(ConfigError, match="'fcfs' takes no options"):
        resolve_plugins(load_config(overrides={"scheduler": {"policy_options": {"x": 1}}}))


def test_did_you_mean_for_policy_and_attention():
    with pytest.raises(ConfigError) as e:
        resolve_plugins(load_config(overrides={"scheduler": {"policy": "priorty"}}))
    assert "Did you mean 'priority'?" in str(e.value) and "fcfs, priority" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve_plugins(load_config(overrides={"attention": {"backend": "torh"}}))
    assert "Did you mean 'torch'?" in str(e.value)


def _paged(args, env_extra=None, **kw):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "paged.core.cli", *args], capture_output=True, text=True, env=env, **kw)


def test_paged_plugins_lists_text_and_json():
    text = _paged(["plugins"])
    assert text.returncode == 0, text.stderr
    assert "policies  [ok]  (paged 0.1.0)" in text.stdout and "policies: fcfs, priority" in text.stdout
    data = json.loads(_paged(["plugins", "--json"]).stdout)
    names = {p["name"]: p for p in data["plugins"]}
    assert names["attention"]["provides"] == {"attention_backends": ["torch", "triton", "flashinfer"]}
    assert names["models"]["provides"]["models"] == ["LlamaForCausalLM", "Qwen2ForCausalLM"]


@pytest.fixture(scope="module")
def example_plugin_site(tmp_path_factory):
    """pip-install the example plugin package (its own pyproject and entry point) into a
    separate target directory, without touching paged or the test environment."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    src = build / "paged-example-plugin"
    import shutil

    shutil.copytree(FIXTURE, src)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_installed_example_plugin_is_listed_and_selectable(example_plugin_site):
    env = {"PYTHONPATH": str(example_plugin_site)}
    data = json.loads(_paged(["plugins", "--json"], env).stdout)
    plugin = {p["name"]: p for p in data["plugins"]}["shortest_first"]
    assert plugin["distribution"] == "paged-example-plugin" and plugin["version"] == "0.2.0"
    assert plugin["provides"] == {"policies": ["shortest-first"]}
    proc = _paged(["config", "--json", "--policy=shortest-first", "--policy-option", "tokens_per_s=3"], env)
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert config["scheduler"]["policy"] == "shortest-first"
    assert config["scheduler"]["policy_options"] == {"tokens_per_s": "3"}
    bad = _paged(["config", "--policy=shortest-first", "--policy-option", "tokens_per_s=-2"], env)
    assert bad.returncode == 2 and "scheduler.policy_options.tokens_per_s" in bad.stderr
    # Without the plugin on the path, the same selection is a clear error.
    missing = _paged(["config", "--policy=shortest-first"])
    assert missing.returncode == 2 and "unknown value 'shortest-first'" in missing.stderr
