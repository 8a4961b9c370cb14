"""The settings of engine cores on several nodes, checked before anything starts (each error names
the setting), what the API server compares between cores (the fingerprint) and the router's
handling of a lost core; the processes themselves: ``tests/e2e/test_nodes.py``."""

from __future__ import annotations

import json
import re
import stat

import pytest

from paged.core.config import load_config
from paged.core.errors import ConfigError
from paged.core.frontend.dp_router import DataParallelRouter
from paged.core.ipc.nodes import addresses, check_node_security, create_keys, fingerprint_difference


def parallel(**settings):
    return load_config(None, {"parallel": settings}).parallel


def test_vllm_style_node_settings():
    first = parallel(data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="10.0.0.1",
                     data_parallel_rpc_port=13345, data_parallel_keys="/k")
    assert list(first.local_ranks) == [0, 1] and first.multi_node
    assert addresses(first) == ("tcp://10.0.0.1:13345", "tcp://10.0.0.1:13346")
    second = parallel(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, headless=True,
                      data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345)
    assert list(second.local_ranks) == [2, 3]
    assert list(parallel(data_parallel_size=3).local_ranks) == [0, 1, 2] and not parallel().multi_node
    assert addresses(parallel(data_parallel_address="::1"))[0] == "tcp://[::1]:29550"


@pytest.mark.parametrize("settings, message", [
    (dict(data_parallel_size=4, data_parallel_size_local=2), "data_parallel_size_local: 2 of 4 cores here needs "
     "data_parallel_address"),
    (dict(headless=True, data_parallel_size=2, data_parallel_start_rank=1), "headless: needs data_parallel_address"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1, data_parallel_address="h"), "data_parallel_start_rank: 1 "
     "on the node with the API server"),
    (dict(data_parallel_size=4, data_parallel_size_local=3, data_parallel_start_rank=2, headless=True,
          data_parallel_address="h"), "data_parallel_start_rank 2 + data_parallel_size_local 3 exceeds "
     "data_parallel_size 4"),
    (dict(data_parallel_size=2, data_parallel_size_local=0, data_parallel_address="h"), "the API server node runs at "
     "least rank 0"),
    (dict(data_parallel_heartbeat_s=5, data_parallel_timeout_s=2), "data_parallel_timeout_s: 2.0 must exceed"),
])
def test_node_settings_that_cannot_work_name_the_setting(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parallel(**settings)


def test_traffic_between_machines_needs_keys(tmp_path):
    check_node_security(parallel(data_parallel_address="127.0.0.1"))  # loopback: keys optional
    with pytest.raises(ConfigError, match="parallel.data_parallel_keys: engine cores on other machines connect to "
                                          "'10.0.0.1'.*paged keys DIR"):
        check_node_security(parallel(data_parallel_address="10.0.0.1"))
    with pytest.raises(ConfigError, match="has no server.key, node.key_secret; create the keys with `paged keys DIR`"):
        check_node_security(parallel(data_parallel_address="10.0.0.1", data_parallel_keys=str(tmp_path)))
    written = create_keys(tmp_path / "keys")
    assert sorted(p.name for p in written) == ["node.key", "node.key_secret", "server.key", "server.key_secret"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written if p.name.endswith("_secret"))
    check_node_security(parallel(data_parallel_address="10.0.0.1", data_parallel_keys=str(tmp_path / "keys")))
    with pytest.raises(ConfigError, match="exists; remove it or choose another folder"):
        create_keys(tmp_path / "keys")


def test_fingerprint_difference_names_each_field():
    a = json.dumps({"max_model_len": 512, "dtype": "float32", "paged": "0.1.0"})
    b = json.dumps({"max_model_len": 256, "dtype": "bfloat16", "paged": "0.1.0"})
    assert fingerprint_difference(a, b) == "dtype 'float32' != 'bfloat16', max_model_len 512 != 256"
    assert fingerprint_difference(a, a) == ""


def test_a_lost_core_gets_nothing_until_it_rejoins():
    router = DataParallelRouter(3, 4, max_hashes=100)
    prompt = list(range(12))
    assert [router.route(f"r{i}", prompt if i == 0 else [100 + i]) for i in range(3)] == [0, 1, 2]
    assert router.route("r3", prompt) == 0  # its prefix is on core 0
    assert sorted(router.drop_core(0)) == ["r0", "r3"]
    assert router.loads[0] == 0 and all(core != 0 for core in router.block_owner.values())
    assert {router.route(f"s{i}", prompt) for i in range(4)} == {1, 2}  # never the lost core
    router.restore_core(0)
    assert router.route("t", [9]) == 0  # the least loaded again
    for core in (0, 1, 2):
        router.drop_core(core)
    with pytest.raises(ValueError, match="every engine core is lost"):
        router.route("u", [1])
