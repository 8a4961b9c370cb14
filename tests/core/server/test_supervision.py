"""What `paged serve` does when its engine core dies (issue 23 A), with `server.on_engine_death =
restart`: the open requests fail at once, /health is 503 until a new engine is up, then 200, and
the restarted engine serves with every KV block free; SIGTERM still exits 0. (The default, exit
with code 1, is tested in tests/core/server/test_server.py; one dead core of two, restarted and then given up on,
in tests/core/server/test_server_dp.py.) Plus the backoff schedule and the options' validation, without a server."""

import os
import signal
import threading

import pytest
from helpers.server import API_KEY, alive, free_port, serve, wait_for

from paged.core.config import load_config
from paged.core.errors import ConfigError
from paged.core.server.state import restart_delay

NUM_BLOCKS = 64


def test_restart_backoff_doubles_up_to_its_cap():
    assert [restart_delay(k, 1.0, 30.0) for k in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_delay(10**6, 0.5, 5.0) == 5.0  # no overflow however long the streak


@pytest.mark.parametrize("server,needle", [
    ({"on_engine_death": "reboot"}, "server.on_engine_death"),
    ({"max_restarts": 0}, "server.max_restarts"),
    ({"restart_backoff_s": 0}, "server.restart_backoff_s"),
    ({"restart_backoff_s": 10, "restart_backoff_max_s": 5}, "server.restart_backoff_max_s"),
])
def test_supervision_options_are_validated(server, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"server": server})
    assert needle in str(e.value)


def test_supervision_defaults_exit_like_vllm():
    server = load_config(None, {}).server
    assert server.on_engine_death == "exit"
    assert (server.max_restarts, server.restart_backoff_s, server.restart_backoff_max_s) == (5, 1.0, 30.0)


@pytest.mark.slow
def test_restart_after_core_death(default_model_dir, tmp_path):
    from openai import APIError, APIStatusError, APITimeoutError, OpenAI

    port = free_port()
    args = ["--model", default_model_dir, "--device", "cpu", "--attention", "torch", "--host", "127.0.0.1",
            "--port", str(port), "--api-key", API_KEY, "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", "256",
            "--on-engine-death", "restart", "--restart-backoff-s", "1", "--max-restarts", "2"]
    with serve(args, tmp_path, port) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        old_pid = s.debug()["core_pid"]
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        unstreamed: dict = {}

        def one_more():
            try:
                client.completions.create(model=model, prompt="Hello", max_tokens=200, extra_body={"ignore_eos": True})
            except APIError as e:
                unstreamed["error"] = e

        thread = threading.Thread(target=one_more)
        thread.start()
        wait_for(lambda: s.debug()["front_end_unfinished_requests"] == 2, 30, "both requests in flight", 0.05)
        os.kill(old_pid, signal.SIGKILL)
        received = 1
        with pytest.raises(APIError) as ended:  # the server's error, not the client's timeout
            for _ in stream:
                received += 1
        assert not isinstance(ended.value, APITimeoutError) and received < 200
        thread.join(60)
        assert isinstance(unstreamed.get("error"), APIStatusError) and unstreamed["error"].status_code == 503

        # Down until the new engine is up (1 s of backoff and a model load later), saying why.
        r = s.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert f"pid {old_pid}" in r.json()["error"]["message"]
        wait_for(lambda: "restart 1 of 2 in 1 s" in s.get("/health").json()["error"]["message"], 10,
                  "/health to tell the restart", 0.05)
        with pytest.raises(APIStatusError) as e:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
        wait_for(lambda: s.get("/health").status_code == 200, 600, "/health to return 200 after the restart")
        new_pid = s.debug()["core_pid"]
        assert new_pid != old_pid and not alive(old_pid)
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4

        def all_blocks_free():
            debug = s.debug(stats=True)
            return (debug["front_end_unfinished_requests"] == 0
                    and debug["core"]["num_free_blocks"] == debug["core"]["num_blocks"] == NUM_BLOCKS)

        wait_for(all_blocks_free, 30, "every KV block of the new core free")
        log = s.log.read_text()
        assert f"pid {old_pid}" in log and "restart 1 of 2 in 1 s" in log and "engine restarted" in log, log[-3000:]

        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.log_tail()
        wait_for(lambda: not alive(new_pid), 10, "the restarted engine core to exit")
