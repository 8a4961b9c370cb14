"""Typed configuration: precedence, nesting, unknown keys, field-level errors, example files."""

import json
import subprocess
import sys

import pytest

from paged.core.config import EngineConfig, dump_config, load_config, resolve_plugins
from paged.core.errors import ConfigError
from paged.core.frontend.llm import settings_to_overrides
from helpers import REPO_ROOT

ROOT = REPO_ROOT


def test_defaults():
    config = load_config()
    assert config.cache.block_size == 16 and config.cache.enable_prefix_caching
    assert config.scheduler.policy == "fcfs" and config.attention.backend == "auto"
    assert config.server.host == "127.0.0.1"


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text('[scheduler]\npolicy = "priority"\nmax_num_seqs = 7\nmax_num_batched_tokens = 99\n[cache]\nblock_size = 8\n')
    config = load_config(path)
    assert (config.scheduler.policy, config.scheduler.max_num_seqs, config.cache.block_size) == ("priority", 7, 8)
    monkeypatch.setenv("PAGED_SCHEDULER__MAX_NUM_SEQS", "9")
    monkeypatch.setenv("PAGED_CACHE__BLOCK_SIZE", "32")
    config = load_config(path)
    assert config.scheduler.max_num_seqs == 9 and config.cache.block_size == 32
    assert config.scheduler.max_num_batched_tokens == 99  # file value kept where env is silent
    config = load_config(path, {"scheduler": {"max_num_seqs": 11}})
    assert config.scheduler.max_num_seqs == 11 and config.cache.block_size == 32
    assert config.scheduler.policy == "priority"  # nested sections merge, not replace


def test_yaml_file_and_plugin_options(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  policy: priority\n  policy_options:\n    aging_s: 4\n")
    config = load_config(path)
    assert resolve_plugins(config).policy_options.aging_s == 4.0


@pytest.mark.parametrize(
    "data, needle",
    [
        ('[cache]\nblok_size = 8\n', "cache.blok_size: unknown setting"),
        ('[cach]\nblock_size = 8\n', "cach: unknown setting"),
        ('[cache]\nblock_size = 12\n', "cache.block_size: Value error, must be a power of two between 1 and 256, got 12"),
        ('[scheduler]\nmax_num_seqs = "many"\n', "scheduler.max_num_seqs: Input should be a valid integer"),
        ('device = "tpu"\n', "device: Input should be 'auto', 'cpu' or 'cuda' (got 'tpu')"),
    ],
)
def test_bad_file_values_name_field_value_and_what_is_accepted(tmp_path, data, needle):
    path = tmp_path / "bad.toml"
    path.write_text(data)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value)


def test_bad_env_value_is_a_field_error(monkeypatch):
    monkeypatch.setenv("PAGED_CACHE__GPU_MEMORY_UTILIZATION", "1.5")
    with pytest.raises(ConfigError, match=r"cache.gpu_memory_utilization: Input should be less than or equal to 1 \(got '1.5'\)"):
        load_config()


def test_missing_or_unparsable_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "x.toml"
    bad.write_text("[cache\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    other = tmp_path / "x.ini"
    other.write_text("")
    with pytest.raises(ConfigError, match=r"must end in .toml, .yaml or .yml"):
        load_config(other)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.*")), ids=lambda p: p.name)
def test_example_deployment_configs_load_and_resolve(path):
    config = load_config(path)
    assert isinstance(config, EngineConfig)
    resolve_plugins(config, device="cpu")


def test_llm_keyword_settings_map_to_sections():
    overrides = settings_to_overrides(
        {"policy": "priority", "max_num_seqs": 4, "enable_prefix_caching": False, "cache": {"block_size": 8},
         "policy_options": {"aging_s": 1}, "device": "cpu"}
    )
    assert overrides == {
        "scheduler": {"policy": "priority", "max_num_seqs": 4, "policy_options": {"aging_s": 1}},
        "cache": {"enable_prefix_caching": False, "block_size": 8},
        "device": "cpu",
    }
    with pytest.raises(ConfigError, match="max_num_seq: unknown setting"):
        settings_to_overrides({"max_num_seq": 4})


def _paged(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "paged.core.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))


def test_paged_config_prints_the_effective_configuration(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[scheduler]\npolicy = "fcfs"\nmax_num_seqs = 5\n')
    proc = _paged("config", "--json", "--config", str(path), "--policy=priority", "--block-size", "32",
                  "--no-enable-prefix-caching", env={"PAGED_SCHEDULER__MAX_NUM_SEQS": "6"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["scheduler"]["policy"] == "priority" and data["scheduler"]["max_num_seqs"] == 6
    assert data["cache"]["block_size"] == 32 and data["cache"]["enable_prefix_caching"] is False
    yaml_text = _paged("config").stdout
    assert "scheduler:" in yaml_text and "policy: fcfs" in yaml_text
    assert yaml_text.startswith(dump_config(load_config()))  # then, as comments, what that resolves to


def test_paged_config_rejects_unknown_policy_with_did_you_mean():
    proc = _paged("config", "--policy=fcfss")
    assert proc.returncode == 2
    assert "scheduler.policy: unknown value 'fcfss'. Did you mean 'fcfs'?" in proc.stderr
