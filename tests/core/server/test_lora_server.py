"""``paged serve --enable-lora --lora-modules a=PATH`` with runtime updates on (API key, adapter
folder): adapters listed in /v1/models with their parent, chosen by the request's ``model``, each
greedy-identical to HF transformers with the adapter merged (float32), requests of the base and
of two adapters at once; /v1/load_lora_adapter confined to the folder (``..``, absolute paths and
links out are refused) and checking the adapter (a 400 naming the field); /v1/unload_lora_adapter
under load: the requests in flight finish with the adapter, then its name is unknown, and every KV
block is free."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from helpers.lora_adapters import ALL_TARGETS, hf_greedy, save_adapter, save_base
from helpers.server import serve_default_model, wait_for

pytestmark = pytest.mark.slow
PROMPT = [1, 504, 3575, 282, 4649, 314, 1021, 3575, 282]
NEW_TOKENS = 10
LONG = 300  # tokens of the requests in flight while their adapter is unloaded


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("lora-srv")
    base = save_base(root / "base", default_model_dir, max_position_embeddings=512)
    merged = {
        "a": save_adapter(base, root / "a", 11, r=8, lora_alpha=16, target_modules=ALL_TARGETS),
        "b": save_adapter(base, root / "adapters" / "b", 12, r=4, lora_alpha=4, target_modules=["q_proj", "o_proj"]),
        None: transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval(),
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    expected = {name: tokenizer.decode(hf_greedy(m, PROMPT, NEW_TOKENS)) for name, m in merged.items()}
    adapters = root / "adapters"
    shutil.copytree(root / "a", adapters / "dora")
    config = json.loads((adapters / "dora" / "adapter_config.json").read_text())
    (adapters / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    os.symlink(root / "a", adapters / "link-out")
    return root, base, adapters, expected


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    root, base, adapters, _ = setup
    with serve_default_model(str(base), tmp_path_factory.mktemp("srv"), "--served-model-name", "tiny",
                             "--quantization", "none", "--enable-lora", "--lora-modules", f"a={root / 'a'}",
                             "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                             "--lora-adapter-dir", str(adapters)) as s:
        yield s


def complete(server, model: str, stream: bool = False) -> tuple[int, str, str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    r = server.post("/v1/completions", body)
    if r.status_code != 200:
        return r.status_code, r.text, ""
    if not stream:
        return 200, r.json()["choices"][0]["text"], r.json()["model"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return 200, "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[0]["model"]


def test_models_lists_each_adapter_with_its_parent(server, setup):
    r = server.get("/v1/models")
    assert r.status_code == 200, r.text
    cards = {m["id"]: m for m in r.json()["data"]}
    assert set(cards) == {"tiny", "a"}
    assert cards["tiny"]["parent"] is None
    assert cards["a"]["parent"] == "tiny" and cards["a"]["root"] == str(setup[0] / "a")


def test_each_model_name_runs_its_adapter_at_once(server, setup):
    expected = setup[3]
    names = ["tiny", "a", "tiny", "a"]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: complete(server, n, stream=n == names[2]), names))
    for name, (status, text, model) in zip(names, results):
        assert status == 200, text
        assert model == name
        assert text == expected[None if name == "tiny" else name], name
    r = server.post("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_runtime_loading_stays_inside_the_adapter_folder(server, setup):
    root = setup[0]
    for path in ("../a", str(root / "a"), "link-out", "b/../../a"):
        r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "lora_path" and "lies outside the adapter folder" in r.text
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "dora"})
    assert r.status_code == 400 and "adapter_config.json field use_dora" in r.text, r.text
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"})
    assert r.status_code == 400 and "no such folder" in r.text, r.text
    r = server.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "b"})
    assert r.status_code == 400 and "'a' is already served" in r.text
    r = server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"}, key="wrong")
    assert r.status_code == 401
    assert {m["id"] for m in server.get("/v1/models").json()["data"]} == {"tiny", "a"}


def test_load_then_unload_under_load(server, setup):
    expected = setup[3]
    r = server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})
    assert r.status_code == 200, r.text
    assert {m["id"]: m["parent"] for m in server.get("/v1/models").json()["data"]}["b"] == "tiny"
    names = ["b", "b", "a", "b", "tiny", "b"]

    def long_completion(name):
        return server.post("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
                                               "ignore_eos": True})

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(long_completion, name) for name in names]
        wait_for(lambda: server.debug()["front_end_unfinished_requests"] == 6, 60, "requests in flight", 0.01)
        r = server.post("/v1/unload_lora_adapter", {"lora_name": "b"})
        assert r.status_code == 200, r.text
        assert server.debug()["front_end_unfinished_requests"] > 0  # unloaded while they ran
        results = [f.result() for f in running]
    for name, r in zip(names, results):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == LONG and body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"].startswith(expected[None if name == "tiny" else name]), name
    status, text, _ = complete(server, "b")
    assert status == 404, text
    assert "b" not in {m["id"] for m in server.get("/v1/models").json()["data"]}
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 404
    core = server.debug(stats=True)["core"]
    assert core["num_free_blocks"] == core["num_blocks"]
    # loaded again under the same name it gets a new id: its requests still match HF
    assert server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"}).status_code == 200
    assert complete(server, "b")[1] == expected["b"]
