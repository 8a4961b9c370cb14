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

from helpers.fixture_packages import pip_install_fixture
from paged.core.config import load_config, resolve_plugins
from paged.core.errors import ConfigError, PluginError
from paged.core.registry import get_registry, load_plugins



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
    assert "register_policies" in info["raising"].error  # which hook raised
    assert 'raise ValueError("hook exploded")' in info["raising"].traceback
    assert info["good"].status == "ok" and "lifo" in registry.policies
    assert any("hook exploded" in r.getMessage() for r in caplog.records)


def test_two_plugins_with_the_same_name_conflict_only_for_that_name(tmp_path, monkeypatch):
    _module_dir(tmp_path, monkeypatch, {"first_plugin": GOOD, "second_plugin": GOOD})
    eps = _eps(("first", "first_plugin"), ("second", "second_plugin"), ("policies", "paged.plugins.policies"))
    registry = load_plugins(eps, allow=None, deny=set())
    info = {p.name: p for p in registry.plugins}
    assert info["first"].status == info["second"].status == "conflict"
    assert "'second'" in info["first"].conflicts[0] and "'first'" in info["second"].conflicts[0]
    assert info["policies"].status == "ok"
    assert registry.policy("fcfs").name == "fcfs"  # other names keep working
    with pytest.raises(PluginError) as e:
        registry.policy("lifo")
    assert "'first'" in str(e.value) and "'second'" in str(e.value) and "PAGED_DISABLE_PLUGINS" in str(e.value)


def test_cli_lists_conflicting_and_failed_plugins_and_only_the_clashing_name_fails(tmp_path, monkeypatch, capsys):
    from paged.core import registry as registry_module
    from paged.core.cli.main import main

    raising = "from paged.core.hookspecs import hookimpl\n@hookimpl\ndef register_models():\n    raise KeyError('no arch')\n"
    _module_dir(tmp_path, monkeypatch, {"first_plugin": GOOD, "second_plugin": GOOD, "raising_models_plugin": raising})
    eps = _eps(("first", "first_plugin"), ("second", "second_plugin"), ("raising", "raising_models_plugin"),
               ("policies", "paged.plugins.policies"), ("attention", "paged.plugins.attention"))
    registry = load_plugins(eps, allow=None, deny=set())
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "first  [conflict]" in out and "second  [conflict]" in out and "also registered by 'second'" in out
    assert "register_models raised KeyError" in out and "--verbose" in out and "Traceback" not in out
    assert main(["plugins", "--verbose"]) == 0
    assert "Traceback (most recent call last)" in capsys.readouterr().out
    assert main(["config", "--policy", "fcfs", "--device", "cpu"]) == 0  # not using the clashing name: fine
    capsys.readouterr()
    assert main(["config", "--policy", "lifo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "'lifo' is registered by several plugins: 'first' and 'second'" in err


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
    assert names["models"]["provides"]["models"] == ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"]


@pytest.fixture(scope="module")
def example_plugin_site(tmp_path_factory):
    return pip_install_fixture("paged-example-plugin", tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("build"))


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
    assert config["scheduler"]["policy_options"] == {"tokens_per_s": 3.0}  # typed by the options model
    bad = _paged(["config", "--policy=shortest-first", "--policy-option", "tokens_per_s=-2"], env)
    assert bad.returncode == 2 and "scheduler.policy_options.tokens_per_s" in bad.stderr
    # Without the plugin on the path, the same selection is a clear error.
    missing = _paged(["config", "--policy=shortest-first"])
    assert missing.returncode == 2 and "unknown value 'shortest-first'" in missing.stderr
