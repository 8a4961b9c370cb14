"""AsyncLLM's data-parallel bookkeeping against a fake two-core client (no processes, no model):
which core each child request and each abort goes to, loads as requests end, utility calls to
every core, and the clean-up when a core dies."""

import asyncio

import pytest

from paged.core.frontend.async_llm import AsyncLLM
from paged.core.config import load_config
from paged.core.engine.model_info import ModelInfo
from paged.core.engine.outputs import EngineCoreOutput, EngineCoreRequest
from paged.core.ipc.messages import AbortRequests, AddRequests, Outputs, UtilityCall
from paged.core.sampling_params import SamplingParams

BLOCK = 16


class _QuietPull:
    async def poll(self, timeout_ms: int) -> bool:
        await asyncio.sleep(timeout_ms / 1000)
        return False


class FakeClient:
    """Records (message, core); answers utility calls at once with ``answers[method][core]``."""

    def __init__(self, num_cores: int, answers: dict) -> None:
        self.num_cores = num_cores
        self.model_infos = [ModelInfo("/m", 256, 49152, [2], 64, BLOCK) for _ in range(num_cores)]
        self.model_info = self.model_infos[0]
        self.pids = [100 + i for i in range(num_cores)]
        self.pid = self.pids[0]
        self.pull = _QuietPull()
        self.decoder = None
        self.alive = True
        self.closed = False
        self.sent: list[tuple[object, int]] = []
        self.terminated = False
        self.answers = answers
        self.llm: AsyncLLM | None = None
        self.multi_node = False
        self.keep_serving = False
        self.lost: dict[int, str] = {}
        self.hosts = [""] * num_cores

    def live_ranks(self) -> list[int]:
        return list(range(self.num_cores))

    def core_down(self, rank: int) -> str | None:
        return None if self.alive else "a core died"

    async def send(self, msg, core: int = 0) -> None:
        self.sent.append((msg, core))
        if isinstance(msg, UtilityCall):
            fut = self.llm._utility_futures[msg.call_id]
            asyncio.get_running_loop().call_soon(fut.set_result, self.answers[msg.method][core])

    def send_nowait(self, msg, core: int = 0) -> None:
        self.sent.append((msg, core))

    def death_message(self) -> str:
        return "a core died"

    def terminate(self) -> None:
        self.terminated = True

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from paged.core.loading.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def _llm(tokenizer, answers=None) -> tuple[AsyncLLM, FakeClient]:
    config = load_config(None, {"parallel": {"data_parallel_size": 2}})
    client = FakeClient(2, answers or {})
    llm = AsyncLLM(config, client, tokenizer)
    client.llm = llm
    return llm, client


def _adds(client: FakeClient) -> dict[str, int]:
    """Each added request's core (a request's samples for one core come in one AddRequests)."""
    adds = {}
    for m, core in client.sent:
        for request in (m.requests if isinstance(m, AddRequests) else [m]):
            if isinstance(request, EngineCoreRequest):
                adds[request.request_id] = core
    return adds


def _aborts(client: FakeClient) -> list[tuple[list[str], str, int]]:
    return [(m.request_ids, m.status, core) for m, core in client.sent if isinstance(m, AbortRequests)]


def test_children_aborts_and_finishes_go_to_their_cores(tokenizer):
    async def main():
        llm, client = _llm(tokenizer)
        long_prompt = list(range(1000, 1000 + 3 * BLOCK))  # 3 full blocks
        await llm.add_request("a", long_prompt, SamplingParams(max_tokens=8, n=2))
        await llm.add_request("b", [5, 6, 7], SamplingParams(max_tokens=8))
        await llm.add_request("c", [8, 9], SamplingParams(max_tokens=8))
        # a#1 follows a#0's prefix (within the slack); b and c balance the load.
        assert _adds(client) == {"a#0": 0, "a#1": 0, "b": 1, "c": 1}
        assert llm.core_loads() == [2, 2]
        # a#0 finishes in core 0; b ends its text with nothing to abort.
        llm._process_outputs(Outputs([EngineCoreOutput("a#0", [11], finish_reason="length"),
                                      EngineCoreOutput("b", [12], finish_reason="stop")], 1.0))
        assert llm.core_loads() == [1, 1]
        # The client of "a" goes away: only a#1 is aborted, and only in core 0.
        llm.abort("a")
        assert _aborts(client) == [(["a#1"], "abort", 0)]
        assert llm.core_loads() == [0, 1]
        llm.abort("a")  # twice: nothing more is sent
        assert len(_aborts(client)) == 1
        # A late output of the aborted child changes nothing.
        llm._process_outputs(Outputs([EngineCoreOutput("a#1", [13], finish_reason="abort")], 2.0))
        assert llm.core_loads() == [0, 1]
        # A dead core: every pending request fails, the router forgets all, the others are stopped.
        stream = llm.streams["c"]
        llm._on_core_death("a core died")
        assert llm.core_loads() == [0, 0] and not llm.router.core_of and not llm.router.block_owner
        assert client.terminated
        with pytest.raises(Exception, match="a core died"):
            await stream.__anext__()
        llm.shutdown()

    asyncio.run(main())


def test_utility_calls_go_to_every_core(tokenizer):
    stats = [{"num_running": 1, "num_waiting": 0, "kv_usage": 0.5, "peak_kv_usage": 0.5, "num_blocks": 64,
              "num_free_blocks": 32, "pid": 100, "num_requests_added": 3},
             {"num_running": 2, "num_waiting": 1, "kv_usage": 0.0, "peak_kv_usage": 0.25, "num_blocks": 64,
              "num_free_blocks": 64, "pid": 101, "num_requests_added": 4}]

    async def main():
        llm, client = _llm(tokenizer, {"stats": stats, "reset_prefix_cache": [True, True]})
        combined = await llm.get_stats()
        assert [core for m, core in client.sent if isinstance(m, UtilityCall)] == [0, 1]
        assert combined["num_running"] == 3 and combined["num_waiting"] == 1
        assert combined["kv_usage"] == pytest.approx(32 / 128) and combined["peak_kv_usage"] == 0.5
        assert combined["pids"] == [100, 101] and llm.last_core_stats == stats
        await llm.add_request("p", list(range(2 * BLOCK)), SamplingParams(max_tokens=4))
        assert llm.router.block_owner
        assert await llm.reset_prefix_cache() is True
        assert not llm.router.block_owner  # the cores' caches are empty: forget where prefixes were
        client.answers["reset_prefix_cache"] = [True, False]  # core 1 still holds blocks
        await llm.add_request("q", list(range(2 * BLOCK)), SamplingParams(max_tokens=4))
        assert await llm.reset_prefix_cache() is False
        assert llm.router.block_owner
        llm.shutdown()

    asyncio.run(main())


def test_add_requests_validates_all_then_sends_one_message_per_core(tokenizer):
    from paged.core.errors import InvalidRequestError

    async def main():
        llm, client = _llm(tokenizer)
        params = SamplingParams(max_tokens=4)
        with pytest.raises(InvalidRequestError, match="prompt"):  # the third is empty: nothing is sent
            await llm.add_requests(["x", "y", "z"], [[5, 6], [7, 8], []], params)
        assert client.sent == [] and not llm.requests
        with pytest.raises(InvalidRequestError, match="request_id"):
            await llm.add_requests(["x", "x"], [[5, 6], [7, 8]], params)
        streams = await llm.add_requests(["p", "q", "r", "s"], [[5, 6], [7, 8], [9, 10], [11, 12]], params)
        assert [s.request_id for s in streams] == ["p", "q", "r", "s"]
        # the router balances four short prompts over two cores: two per core, in one message each
        assert sorted(core for _, core in client.sent) == [0, 1]
        assert all(isinstance(m, AddRequests) and len(m.requests) == 2 for m, _ in client.sent)
        assert sorted(_adds(client)) == ["p", "q", "r", "s"] and llm.core_loads() == [2, 2]
        llm.shutdown()

    asyncio.run(main())
