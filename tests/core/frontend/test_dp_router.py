"""The data-parallel routing policy (paged.core.frontend.dp_router) and the combination of the cores' stats
(paged.core.frontend.dp_stats), on hand-built cases: no model, no process."""

import random

import pytest

from paged.core.engine.block_pool import hash_block_tokens
from paged.core.frontend.dp_router import DEFAULT_SLACK, DataParallelRouter
from paged.core.frontend.dp_stats import combine_core_stats
from paged.core.engine.kv_cache_manager import KVCacheManager, extend_block_hashes
from paged.core.engine.request import Request

BS = 4  # block size


def prompt(prefix: int, num_blocks: int, tail: int = 0, tail_seed: int = 0) -> list[int]:
    """``num_blocks`` full blocks of a prefix family ``prefix``, then ``tail`` distinct tokens."""
    return [1000 * prefix + i for i in range(num_blocks * BS)] + [50_000 + tail_seed * 100 + i for i in range(tail)]


def router(num_cores: int = 2, **kw) -> DataParallelRouter:
    return DataParallelRouter(num_cores, BS, max_hashes=kw.pop("max_hashes", 1000), **kw)


def test_the_router_keys_are_the_keys_the_cores_cache_finds():
    """The router's block keys are the cores' prefix-cache keys: a prompt routed to a core and
    computed there leaves in the core's cache exactly the blocks the router remembers for that
    core, and for a sibling prompt the router's known match is what that core's cache finds."""
    r = router(2)
    cores = [KVCacheManager(32, BS) for _ in range(2)]

    def compute_on(core: int, request: Request) -> int:
        """Run ``request``'s prompt on ``core``'s KV cache manager as the engine would; the
        prefix-cache hit (tokens) it found."""
        kv = cores[core]
        blocks, num_cached = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks) is not None
        kv.free(request)
        return num_cached

    tokens = prompt(1, 3, tail=2)
    core = r.route("a", tokens, cache_salt="salt")
    first = Request("a", tokens, cache_salt="salt")
    assert compute_on(core, first) == 0
    r.finish("a")
    # The core's keys, chained by hand: SHA-256 of the parent, the block's ids, the salt (block 0 only).
    by_hand, parent = [], None
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS], ("salt",) if i == 0 else ())
        by_hand.append(parent)
    assert first.block_hashes == by_hand
    assert dict(r.block_owner) == {h: core for h in by_hand}
    assert all(cores[core].block_pool.get_cached_block(h) is not None for h in by_hand)

    # A sibling sharing two blocks: the router's match on that core is the core's cache hit.
    sibling = Request("b", prompt(1, 2, tail=5, tail_seed=1), cache_salt="salt")
    cores[core].update_block_hashes(sibling)
    assert r.known_match(sibling.block_hashes) == {core: 2}
    # Loads are equal and the round robin would pick the other core: the prefix decides.
    assert r.route("b", sibling.prompt_token_ids, cache_salt="salt") == core
    assert compute_on(core, sibling) == 2 * BS
    # The same tokens under another salt: no key in common, for the router as for the core.
    other = Request("c", prompt(1, 3, tail=2), cache_salt="pepper")
    cores[core].update_block_hashes(other)
    assert r.known_match(other.block_hashes) == {} and cores[core].get_computed_blocks(other)[1] == 0


class ReferenceRouter:
    """The module docstring's rule written the plain way, to compare the router with: keys
    chained by hand, the LRU map as a list (oldest first), each core's known match by scanning
    the prompt's blocks, the choice by sorting."""

    def __init__(self, num_cores: int, max_hashes: int, slack: int) -> None:
        self.num_cores, self.max_hashes, self.slack = num_cores, max_hashes, slack
        self.loads = [0] * num_cores
        self.core_of: dict[str, int] = {}
        self.lru: list[bytes] = []
        self.last_sent: dict[bytes, int] = {}
        self.last_round_robin = -1

    @staticmethod
    def keys(tokens: list[int], salt: str | None) -> list[bytes]:
        keys, parent = [], None
        for i in range(len(tokens) // BS):
            parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS], (salt,) if i == 0 and salt else ())
            keys.append(parent)
        return keys

    def match(self, keys: list[bytes], core: int) -> int:
        """The longest k: the first k blocks all remembered, the k-th last sent to ``core``."""
        for k in range(len(keys), 0, -1):
            if all(h in self.last_sent for h in keys[:k]) and self.last_sent[keys[k - 1]] == core:
                return k
        return 0

    def route(self, request_id: str, tokens: list[int], salt: str | None) -> int:
        keys = self.keys(tokens, salt)
        min_load = min(self.loads)
        matches = {c: self.match(keys, c) for c in range(self.num_cores)}
        eligible = [c for c, k in matches.items() if k > 0 and self.loads[c] <= min_load + self.slack]
        if eligible:  # the longest match, then the lower load, then the lower rank
            core = sorted(eligible, key=lambda c: (-matches[c], self.loads[c], c))[0]
        else:  # the least loaded; among equals, the first after the last round-robin pick
            least = [c for c in range(self.num_cores) if self.loads[c] == min_load]
            core = min(least, key=lambda c: (c - self.last_round_robin - 1) % self.num_cores)
            self.last_round_robin = core
        self.loads[core] += 1
        self.core_of[request_id] = core
        for h in reversed(keys):  # the prompt's first block ends the most recent
            if h in self.lru:
                self.lru.remove(h)
            self.lru.append(h)
            self.last_sent[h] = core
        while len(self.lru) > self.max_hashes:
            del self.last_sent[self.lru.pop(0)]
        return core

    def finish(self, request_id: str) -> None:
        self.loads[self.core_of.pop(request_id)] -= 1


@pytest.mark.parametrize("seed", range(6))
def test_the_router_chooses_what_the_documented_rule_chooses(seed):
    """Random traffic (prefix families of several lengths, tails, salts, finishes, a cache reset)
    on the router and on ``ReferenceRouter``: the same core every time."""
    rng = random.Random(seed)
    num_cores, max_hashes, slack = rng.choice([(2, 12, 2), (3, 8, 1), (4, 40, 0), (3, 1000, 2)])
    r = router(num_cores, max_hashes=max_hashes, slack=slack)
    reference = ReferenceRouter(num_cores, max_hashes, slack)
    live: list[str] = []
    choices = set()
    for step in range(300):
        if live and rng.random() < 0.4:
            request_id = live.pop(rng.randrange(len(live)))
            assert r.finish(request_id) == reference.core_of[request_id]
            reference.finish(request_id)
        elif rng.random() < 0.01:
            r.forget_prefixes()
            reference.lru.clear()
            reference.last_sent.clear()
        else:
            tokens = prompt(rng.randrange(5), rng.randrange(7), tail=rng.randrange(4), tail_seed=rng.randrange(3))
            salt = rng.choice([None, None, "s"])
            request_id = f"r{step}"
            core = r.route(request_id, tokens, cache_salt=salt)
            assert core == reference.route(request_id, tokens, salt), f"step {step}"
            live.append(request_id)
            choices.add(core)
        assert r.loads == reference.loads
    assert choices == set(range(num_cores))  # the traffic reached every core


def test_least_loaded_with_round_robin_ties():
    r = router(3)
    # Short prompts (no full block): pure load balancing; equal loads rotate.
    assert [r.route(f"a{i}", [1, 2]) for i in range(3)] == [0, 1, 2]
    assert r.loads == [1, 1, 1]
    r.finish("a1")
    assert r.route("b", [1, 2]) == 1  # the only least-loaded core
    r.finish("a0")
    r.finish("a2")
    # Loads (0, 1, 0): the ties are 0 and 2; the rotation continues after the last pick (1).
    assert r.route("c", [1, 2]) == 2
    assert r.route("d", [1, 2]) == 0
    assert r.loads == [1, 1, 1] and sum(r.loads) == len(r.core_of)


def test_prefix_preference():
    r = router(2)
    assert r.route("a", prompt(1, 4, tail=2)) == 0
    assert r.route("b", prompt(2, 4)) == 1  # unrelated: the least-loaded core
    r.finish("a")
    r.finish("b")
    # With equal loads each request follows its prefix (the round robin alone would alternate).
    for i in range(4):
        assert r.route(f"a-{i}", prompt(1, 3, tail=3, tail_seed=i)) == 0
        r.finish(f"a-{i}")
        assert r.route(f"b-{i}", prompt(2, 5, tail_seed=i)) == 1
        r.finish(f"b-{i}")
    # The holder of a prefix need not be the least loaded: within the slack the prefix wins.
    assert r.route("q", [7]) == 0
    assert r.route("a-more", prompt(1, 4)) == 0 and r.loads == [2, 0]
    r.finish("q")
    r.finish("a-more")
    # The longest known match wins; a core's match ends at the last block last sent to it.
    hashes = extend_block_hashes([], prompt(3, 6), BS)
    r.block_owner.update({h: 1 for h in hashes})
    assert r.known_match(hashes) == {1: 6}
    r.block_owner.update({h: 0 for h in hashes[:2]})
    assert r.known_match(hashes) == {0: 2, 1: 6}
    assert r.route("c", prompt(3, 6, tail=2)) == 1  # 6 known blocks beat 2
    assert r.known_match(hashes) == {1: 6}  # c's blocks were last sent to core 1, all of them
    del r.block_owner[hashes[3]]  # evicted: the chain breaks there for every core
    assert r.known_match(hashes) == {1: 3}


def test_cache_salt_separates_prefixes():
    r = router(2)
    assert r.route("a", prompt(1, 4), cache_salt="alice") == 0
    # The same tokens under another salt share nothing: least loaded, core 1.
    assert r.route("b", prompt(1, 4), cache_salt="bob") == 1
    r.finish("a")
    r.finish("b")
    assert r.route("c", prompt(1, 4), cache_salt="bob") == 1


def test_lora_adapters_separate_prefixes_as_in_the_cores():
    """A prompt under a LoRA adapter shares no prefix with the same prompt under another adapter or
    the base (the router's keys, as the cores' KV managers compute them for the requests)."""
    from paged.core.lora import LoRARequest

    r = router(2)
    assert r.route("a", prompt(1, 4), lora_int_id=1) == 0
    assert r.route("b", prompt(1, 4), lora_int_id=2) == 1  # no match anywhere: the least loaded
    assert r.route("c", prompt(1, 4)) == 0  # round robin; the base matches neither
    for rid in "abc":
        r.finish(rid)
    assert r.route("d", prompt(1, 4), lora_int_id=2) == 1  # its adapter's blocks are on core 1
    kv = KVCacheManager(32, BS)
    keyed = {}
    for lora_id in (0, 1, 2):
        request = Request(f"r{lora_id}", prompt(1, 4), lora_request=LoRARequest("x", lora_id, "/x") if lora_id else None)
        kv.update_block_hashes(request)
        keyed[lora_id] = request.block_hashes
        assert request.block_hashes == extend_block_hashes([], prompt(1, 4), BS, None, lora_id)
    by_hand = hash_block_tokens(None, prompt(1, 4)[:BS], ("lora:2",))
    assert keyed[2][0] == by_hand and keyed[0][0] == hash_block_tokens(None, prompt(1, 4)[:BS])
    assert len({h for hashes in keyed.values() for h in hashes}) == 12  # nothing shared


def test_slack_overrides_preference():
    r = router(2, slack=2)
    assert r.route("p0", prompt(1, 4)) == 0
    # Siblings of a long prefix stay on core 0 while its load is within min_load + slack ...
    assert r.route("p1", prompt(1, 4)) == 0  # loads (1, 0): 1 <= 0 + 2
    assert r.route("p2", prompt(1, 4)) == 0  # loads (2, 0): 2 <= 0 + 2
    # ... and leave it when it is more than `slack` above the least-loaded core.
    assert r.route("p3", prompt(1, 4)) == 1  # loads (3, 0): 3 > 0 + 2
    assert r.loads == [3, 1]
    # p3 made core 1 the last holder of the prefix; with loads (3, 1) core 1 is preferred.
    assert r.route("p4", prompt(1, 4)) == 1
    # Slack 0: the prefix only wins among the least loaded.
    z = router(2, slack=0)
    assert z.route("a", prompt(1, 4)) == 0
    assert z.route("b", prompt(1, 4)) == 1
    assert DEFAULT_SLACK == 2


def test_no_prefix_affinity_when_the_cores_do_not_cache():
    r = router(2, prefix_affinity=False)
    assert [r.route(f"a{i}", prompt(1, 4)) for i in range(4)] == [0, 1, 0, 1]
    assert not r.block_owner


def test_lru_bound():
    r = router(2, max_hashes=5)
    r.route("a", prompt(1, 4))  # 4 hashes
    r.finish("a")
    r.route("b", prompt(2, 3))  # 3 more: 7 > 5, the 2 least recent go
    assert len(r.block_owner) == 5
    a = extend_block_hashes([], prompt(1, 4), BS)
    b = extend_block_hashes([], prompt(2, 3), BS)
    # Touched last block first, so family 1's tail was evicted and its head kept.
    assert [h in r.block_owner for h in a] == [True, True, False, False]
    assert all(h in r.block_owner for h in b)
    assert r.known_match(a) == {0: 2}
    # A long prompt never holds more than max_hashes entries.
    r.route("c", prompt(3, 40))
    assert len(r.block_owner) == 5
    r.forget_prefixes()
    assert not r.block_owner and r.loads == [1, 1]  # forgetting prefixes keeps the loads


def test_abort_bookkeeping():
    r = router(2)
    cores = {rid: r.route(rid, [1, 2, 3]) for rid in ["x#0", "x#1", "y", "z"]}
    assert cores == {"x#0": 0, "x#1": 1, "y": 0, "z": 1}
    # An abort is grouped by the core that holds each request; unknown ids are left out.
    assert r.group_by_core(["x#0", "x#1", "nope"]) == {0: ["x#0"], 1: ["x#1"]}
    assert r.finish("x#0") == 0
    assert r.finish("x#0") is None  # finishing twice (finished, then aborted) changes nothing
    assert r.group_by_core(["x#0", "x#1"]) == {1: ["x#1"]}
    assert r.loads == [1, 2]
    assert r.finish("x#1") == 1 and r.finish("y") == 0 and r.finish("z") == 1
    assert r.loads == [0, 0] and not r.core_of
    with pytest.raises(ValueError, match="already routed"):
        r.route("a", [1])
        r.route("a", [1])
    r.reset()
    assert r.loads == [0, 0] and not r.core_of and not r.block_owner


def test_invalid_router_settings():
    with pytest.raises(ValueError):
        DataParallelRouter(0, BS, 10)
    with pytest.raises(ValueError):
        DataParallelRouter(2, BS, 0)
    with pytest.raises(ValueError):
        DataParallelRouter(2, BS, 10, slack=-1)


# --- combining the cores' stats ----------------------------------------------------------------
def core_stats(pid: int, blocks: int, free: int, running: int, peak: float, **kw) -> dict:
    return {"num_steps": 10, "num_preemptions": 1, "peak_kv_usage": peak, "num_running": running,
            "num_waiting": 2, "kv_usage": 1 - free / blocks, "prefix_cache_queries": 100,
            "prefix_cache_hits": 40, "num_blocks": blocks, "num_free_blocks": free, "pid": pid,
            "num_requests_added": 5, **kw}


def test_combine_core_stats():
    one = core_stats(11, 100, 75, 3, 0.5)
    assert combine_core_stats([one]) == {**one, "pids": [11]}
    two = combine_core_stats([one, core_stats(22, 300, 300, 0, 0.25)])
    assert two["num_blocks"] == 400 and two["num_free_blocks"] == 375
    assert two["kv_usage"] == pytest.approx(25 / 400)  # over all blocks, not the mean of 0.25 and 0
    assert two["peak_kv_usage"] == 0.5
    assert two["num_running"] == 3 and two["num_waiting"] == 4 and two["num_steps"] == 20
    assert two["prefix_cache_queries"] == 200 and two["prefix_cache_hits"] == 80 and two["num_preemptions"] == 2
    assert two["num_requests_added"] == 10
    assert two["pid"] == 11 and two["pids"] == [11, 22]
    # Values that are not numbers: kept when equal, else listed.
    mixed = combine_core_stats([{"pid": 1, "device": "cpu", "name": "a"}, {"pid": 2, "device": "cpu", "name": "b"}])
    assert mixed == {"pid": 1, "device": "cpu", "name": ["a", "b"], "pids": [1, 2]}
    with pytest.raises(ValueError):
        combine_core_stats([])


def test_each_gpu_core_sees_its_own_slice_of_the_gpus(monkeypatch):
    from paged.core.config import load_config
    from paged.core.ipc.client import _core_devices
    from paged.core.errors import ConfigError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    config = load_config(None, {"device": "cuda", "parallel": {"data_parallel_size": 2, "tensor_parallel_size": 2}})
    assert [_core_devices(config, r) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                             {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert _core_devices(load_config(None, {"device": "cpu", "parallel": {"data_parallel_size": 2}}), 1) == {}
    too_many = load_config(None, {"device": "cuda", "parallel": {"data_parallel_size": 3, "tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match="data_parallel_size: 3 cores on this node x tensor_parallel_size 2 need 6 "
                                          "GPUs; 4"):
        _core_devices(too_many, 2)
    # a node that runs ranks 2 and 3 of 4: its cores count from its own first GPU
    node = load_config(None, {"device": "cuda", "parallel": {
        "data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 2, "headless": True,
        "data_parallel_address": "127.0.0.1", "tensor_parallel_size": 2}})
    assert [_core_devices(node, r - 2) for r in node.parallel.local_ranks] == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                                               {"CUDA_VISIBLE_DEVICES": "6,7"}]


def test_cores_on_a_machine_without_a_gpu_driver_need_no_torch_to_know_it():
    """``device: auto`` with two cores and no CUDA_VISIBLE_DEVICES: where no GPU driver's device
    node exists the front-end gives the cores no GPU slice without importing torch, and torch
    agrees that no GPU is there."""
    import os
    import subprocess
    import sys

    from paged.core.ipc.client import no_gpu_driver

    if not no_gpu_driver():
        pytest.skip("a GPU driver is installed here: the front-end asks torch")
    script = ("import sys\nfrom paged.core.config import load_config\nfrom paged.core.ipc.client import _core_devices\n"
              "config = load_config(None, {'parallel': {'data_parallel_size': 2}})\n"
              "print(_core_devices(config, 1), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["{}", "False"], out.stdout + out.stderr
    import torch

    assert not torch.cuda.is_available()
