"""`paged serve --data-parallel-size 2` end to end: two engine-core processes behind one front-end,
a real server subprocess on a loopback port (helpers from test_server). Outputs equal one core's,
both cores serve, a shared prefix follows its core, aborts and stops reach the core that holds
the request, one dead core is a dead engine (restarted whole with server.on_engine_death =
restart), and shutdown stops every core. Plus the offline
engine's refusal of data parallelism."""

import asyncio
import os
import signal
import time

import pytest
from helpers.server import API_KEY, alive, free_port, serve, wait_for

from paged.core.errors import ConfigError
from paged.core.sampling_params import SamplingParams

DP = 2
MODEL = "tiny"  # --served-model-name
MAX_TOKENS = 16
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128  # per core
LONG = ("You are a careful assistant who answers questions about geography, history and science. "
        "Answer in one short sentence, without any preamble, and never repeat the question back. ")
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    LONG + "Question: what is the capital of Italy? Answer:",
    LONG + "Question: who painted the Mona Lisa? Answer:",
    "Once upon a time, in a small village at the edge of a great forest, there lived a",
    "The three primary colours are",
    "My favourite programming language is",
    "In 1969, the first humans",
    "The best way to learn a language is to",
    "Photosynthesis is the process by which",
]


def _core_args(port: int) -> list[str]:
    return ["--device", "cpu", "--dtype", "float32", "--attention", "torch", "--host", "127.0.0.1", "--port", str(port),
            "--api-key", API_KEY, "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "32", "--served-model-name", MODEL, "--data-parallel-size", str(DP), "-q"]


def _cores(server) -> list[dict]:
    return server.debug(stats=True)["cores"]


def _added(server) -> list[int]:
    return [c["num_requests_added"] for c in _cores(server)]


def _all_blocks_back(server) -> bool:
    cores = _cores(server)
    return all(c["num_running"] == 0 and c["num_waiting"] == 0 and c["front_end_load"] == 0
               and c["num_free_blocks"] == c["num_blocks"] == NUM_BLOCKS for c in cores)


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_server(default_model_dir, tmp_path_factory):
    port = free_port()
    with serve(["--model", default_model_dir, *_core_args(port)], tmp_path_factory.mktemp("dp"), port) as s:
        debug = s.debug()
        assert debug["data_parallel_size"] == DP and len(set(debug["core_pids"])) == DP
        s.core_pids = debug["core_pids"]
        yield s
        # Shutdown stops every core: the server exits 0 and takes both with it.
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.log_tail()
        wait_for(lambda: not any(alive(pid) for pid in s.core_pids), 10, "every engine core to exit")


@pytest.fixture(scope="module")
def one_core(default_model_dir):
    """Greedy outputs of the offline engine (one core) for PROMPTS."""
    from paged import LLM

    llm = LLM(default_model_dir, device="cpu", dtype="float32", attention="torch", num_kv_blocks=NUM_BLOCKS,
              max_model_len=MAX_MODEL_LEN)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def _client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


# --- offline -----------------------------------------------------------------------------------
def test_offline_engine_refuses_data_parallelism():
    from paged import LLM

    with pytest.raises(ConfigError) as e:
        LLM(data_parallel_size=2)  # refused before any model is loaded
    message = str(e.value)
    assert "parallel.data_parallel_size" in message and "2" in message and "paged serve" in message


# --- serving -----------------------------------------------------------------------------------
def test_concurrent_batch_equals_one_core_and_uses_both(dp_server, one_core):
    """12 prompts at once, half streamed, half not with n=2 (children routed on their own)."""
    before = _added(dp_server)

    async def one(client, i: int, prompt: str) -> list[str]:
        if i % 2 == 0:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
            return ["".join([c.choices[0].text async for c in stream if c.choices])]
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    async def main():
        client = _client(dp_server)
        try:
            return await asyncio.gather(*[one(client, i, p) for i, p in enumerate(PROMPTS)])
        finally:
            await client.close()

    results = asyncio.run(main())
    for prompt, texts in zip(PROMPTS, results):
        assert texts == [one_core[prompt]] * len(texts), prompt
    added = [a - b for a, b in zip(_added(dp_server), before)]
    assert sum(added) == 6 + 6 * 2  # every core request was sent to exactly one core
    assert all(n >= 4 for n in added), added  # both served, neither starved (slack 2 per pick)
    debug = dp_server.debug(stats=True)
    assert debug["front_end_unfinished_requests"] == 0 and _all_blocks_back(dp_server)
    assert debug["core"]["num_blocks"] == DP * NUM_BLOCKS and debug["core"]["pids"] == dp_server.core_pids
    metrics = dp_server.metrics()
    assert metrics["paged:num_kv_blocks"] == DP * NUM_BLOCKS
    for rank in range(DP):
        host = dp_server.debug(stats=True)["cores"][rank]["host"]
        assert metrics[f'paged:core_requests_added_total{{dp_rank="{rank}",host="{host}"}}'] == _added(dp_server)[rank]
    assert metrics["paged:engine_cores_serving"] == DP


def test_shared_prefix_follows_its_core(dp_server):
    """Sequential requests with a long shared prefix all go to the core that has it cached (with
    equal loads the round robin alone would alternate) and hit its prefix cache."""
    prefix = ("Here is a long preamble that several requests share, long enough to fill a few KV blocks "
              "of sixteen tokens each: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu "
              "nu xi omicron pi rho sigma tau upsilon phi chi psi omega. ") * 2  # 113 tokens: 7 full blocks
    first = None
    for i, question in enumerate(["What comes after alpha?", "What comes before omega?", "Name a Greek letter.",
                                  "How many letters are listed?"]):
        before = _cores(dp_server)
        r = dp_server.post("/v1/completions", {"prompt": prefix + question, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        after = _cores(dp_server)
        added = [a["num_requests_added"] - b["num_requests_added"] for a, b in zip(after, before)]
        core = added.index(1)
        assert sorted(added) == [0, 1]
        if first is None:
            first = core
            continue
        assert core == first, f"request {i} went to core {core}, its prefix is on core {first}"
        hits = after[core]["prefix_cache_hits"] - before[core]["prefix_cache_hits"]
        assert hits >= 6 * 16, hits  # the shared prefix's blocks came from that core's cache


def test_aborts_and_stops_reach_the_right_core(dp_server, one_core):
    """Disconnected clients and stop strings abort requests on both cores: every KV block comes
    back, and the cores stop generating (a misrouted abort would let a request run 400 tokens)."""
    tokens = "paged:generation_tokens_total"
    start = dp_server.metrics()[tokens]

    async def disconnect():
        client = _client(dp_server)
        streams = []
        for i in range(4):
            streams.append(await client.completions.create(
                model=MODEL, prompt=PROMPTS[i], max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True}))
        for stream in streams:
            await stream.__anext__()  # a token has arrived: the request runs
        loads = [c["front_end_load"] for c in _cores(dp_server)]
        for stream in streams:
            await stream.close()
        await client.close()
        return loads

    loads = asyncio.run(disconnect())
    assert loads == [2, 2]
    wait_for(lambda: _all_blocks_back(dp_server), 30, "every aborted request's blocks back on both cores")
    assert dp_server.metrics()[tokens] - start < 400

    # Stop strings: the front-end ends the request and tells its core ("stop" abort).
    text = one_core[PROMPTS[1]]
    stop = text.strip().split()[1]
    start = dp_server.metrics()[tokens]

    async def stops():
        client = _client(dp_server)
        try:
            return await asyncio.gather(*[client.completions.create(
                model=MODEL, prompt=PROMPTS[1], max_tokens=400, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True}) for _ in range(4)])
        finally:
            await client.close()

    for r in asyncio.run(stops()):
        assert r.choices[0].finish_reason == "stop" and text.startswith(r.choices[0].text)
    wait_for(lambda: _all_blocks_back(dp_server), 30, "every stopped request's blocks back on both cores")
    assert dp_server.metrics()[tokens] - start < 400


def test_one_dead_core_kills_the_engine_then_both_restart(default_model_dir, tmp_path):
    """With server.on_engine_death = restart: one dead core fails every open request and stops the
    other core; both are started again; a second death within restart_backoff_max_s is one restart
    more than max_restarts = 1 allows, so the server exits with code 1."""
    from openai import APIError, APIStatusError, OpenAI

    port = free_port()
    args = [*_core_args(port), "--on-engine-death", "restart", "--max-restarts", "1", "--restart-backoff-s", "0.5",
            "--restart-backoff-max-s", "600"]
    with serve(["--model", default_model_dir, *args], tmp_path, port) as s:
        pids = s.debug()["core_pids"]
        client = OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=300, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}) for p in PROMPTS[:2]]
        for stream in streams:
            next(iter(stream))
        assert [c["front_end_load"] for c in s.debug(stats=True)["cores"]] == [1, 1]
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        for stream in streams:  # the request on the surviving core fails too
            with pytest.raises(APIError):
                for _ in stream:
                    pass
        assert time.monotonic() - start < 10
        with pytest.raises(APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert e.value.status_code == 503
        r = s.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "data-parallel rank 1" in r.json()["error"]["message"]
        assert s.metrics()["paged:engine_core_alive"] == 0
        # The survivor is stopped at once (its requests have failed; nobody waits for them).
        wait_for(lambda: not alive(pids[0]), 10, "the surviving core to be stopped")

        wait_for(lambda: s.get("/health").status_code == 200, 600, "/health to return 200 after the restart")
        new_pids = s.debug()["core_pids"]
        assert len(set(new_pids)) == DP and not set(new_pids) & set(pids)
        outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True}) for p in PROMPTS[:2]]
        assert [o.usage.completion_tokens for o in outs] == [4, 4]
        wait_for(lambda: _all_blocks_back(s), 30, "every KV block free on both new cores")

        os.kill(new_pids[0], signal.SIGKILL)
        assert s.proc.wait(60) == 1, s.log_tail()
        wait_for(lambda: not any(alive(pid) for pid in new_pids), 10, "every engine core to exit")
        log = s.log.read_text()
        assert "engine restarted" in log and "giving up after 1 restart(s) in a row" in log, log[-3000:]
