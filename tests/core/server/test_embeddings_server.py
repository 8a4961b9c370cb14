"""``paged serve --runner pooling`` with the official client: ``embeddings.create`` (strings, token
ids, float and base64), ``/v1/rerank`` and ``/v2/rerank`` (order against a brute-force cosine
ranking of HF's embeddings), ``/score``, and the 400s naming the field. Values against HF
transformers' final hidden states on the default model's weights (float32, last-token pooling)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from helpers.endpoint_fuzz import fuzz_endpoints
from helpers.server import API_KEY, serve_default_model

pytestmark = pytest.mark.slow
DOCS = ["Paris is the capital of France.", "Bananas are yellow and sweet.", "The Eiffel Tower stands in Paris.",
        "Python is a programming language."]
QUERY = "Which city is the capital of France?"


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    with serve_default_model(default_model_dir, tmp_path_factory.mktemp("srv"), "--runner", "pooling", "--served-model-name", "emb") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    """Text or token ids -> HF's normalised last-token embedding (float64)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    cache = {}

    def embed(text_or_ids):
        ids = tokenizer(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else text_or_ids
        if tuple(ids) not in cache:
            with torch.inference_mode():
                h = model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
            cache[tuple(ids)] = h / np.linalg.norm(h)
        return cache[tuple(ids)]

    embed.tokenizer = tokenizer
    return embed


def test_embeddings_float_and_base64_equal_hf(client, hf):
    ids = hf.tokenizer(DOCS[2])["input_ids"]
    r = client.embeddings.create(model="emb", input=DOCS[:2] + [DOCS[0]])  # the client asks for base64, decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(hf.tokenizer(t)["input_ids"]) for t in DOCS[:2] + [DOCS[0]])
    for text, d in zip(DOCS[:2], r.data):
        got = np.asarray(d.embedding)
        assert float(got @ hf(text)) >= 0.9999 and np.linalg.norm(got) == pytest.approx(1, abs=1e-5)
    assert r.data[2].embedding == pytest.approx(r.data[0].embedding, abs=1e-6)  # the cached prompt again
    # asked for explicitly, the client hands the base64 text over as is (float32, little-endian)
    b64 = client.embeddings.create(model="emb", input=ids, encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vector, hf(ids), atol=2e-4)
    np.testing.assert_allclose(np.asarray(r.data[0].embedding, dtype=np.float32),
                               client.embeddings.create(model="emb", input=DOCS[0], encoding_format="float").data[0].embedding,
                               atol=1e-6)
    lists = client.embeddings.create(model="emb", input=[ids, ids[:3]])
    np.testing.assert_allclose(np.asarray(lists.data[1].embedding), hf(ids[:3]), atol=2e-4)


def test_rerank_and_score_order_as_brute_force_cosine(server, hf):
    q = hf(QUERY)
    want = [float(q @ hf(d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        r = server.post(path, {"model": "emb", "query": QUERY, "documents": DOCS[:2] + [{"text": t} for t in DOCS[2:]],
                               "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        assert [x["relevance_score"] for x in results] == pytest.approx([want[i] for i in order[:3]], abs=1e-4)
        assert results[0]["document"]["text"] == DOCS[order[0]]
    r = server.post("/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False})
    assert len(r.json()["results"]) == len(DOCS) and "document" not in r.json()["results"][0]
    r = server.post("/score", {"model": "emb", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
    pairwise = server.post("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx([float(hf(DOCS[0]) @ hf(DOCS[2])),
                                                            float(hf(DOCS[1]) @ hf(DOCS[3]))], abs=1e-4)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 2], [49152]]}, "prompt_token_ids"),
    ("/v1/embeddings", {"input": "x", "extra": 1}, "extra"),
    ("/v1/embeddings", {"input": ["x"] * 300}, "input"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/completions", {"prompt": "hi"}, "model.runner"),
    ("/classify", {"input": "hi"}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, field):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text
    assert server.post("/v1/embeddings", {"input": "still serving"}).status_code == 200


# --- a seeded fuzz run over the pooling endpoints -------------------------------------------------
def test_seeded_fuzz_no_5xx_no_leak(server):
    statuses = fuzz_endpoints(server, {
        "/v1/embeddings": ({"input": "Hi"}, ["input", "encoding_format", "dimensions", "normalize",
                                             "add_special_tokens", "user", "priority", "bogus"]),
        "/score": ({"text_1": "a", "text_2": ["b", "c"]}, ["text_1", "text_2", "priority", "bogus"]),
        "/v1/rerank": ({"query": "q", "documents": ["a", "b"]},
                       ["query", "documents", "top_n", "return_documents", "max_chunks_per_doc", "bogus"]),
        "/classify": ({"input": "Hi"}, ["input", "add_special_tokens", "priority", "bogus"]),
    }, seed=20261202)
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses
