"""``paged serve --runner pooling`` of a ``*ForSequenceClassification`` checkpoint (a tiny random
Llama cross-encoder, ``helpers.tiny_classifier``): ``/classify`` (vLLM's shape) and ``/rerank``,
``/score`` against HF transformers' ``LlamaForSequenceClassification`` on the same weights
(sigmoid of its logit, ranked by brute force); embeddings refused naming the field; a seeded
fuzz run over the classifier's endpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.endpoint_fuzz import fuzz_endpoints
from helpers.server import serve_default_model
from helpers.tiny_classifier import hf_logits, save_llama_cross_encoder

pytestmark = pytest.mark.slow
TEMPLATE = "Query: {query}\nDocument: {document}"
QUERY = "Which city is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow and sweet.", "The Eiffel Tower stands in Paris.",
        "Python is a programming language."]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("ce") / "llama-ce"
    model = save_llama_cross_encoder(path, default_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, lambda text_or_ids: torch.sigmoid(hf_logits(model, tokenizer, text_or_ids)[0]).item(), tokenizer


@pytest.fixture(scope="module")
def server(cross_encoder, tmp_path_factory):
    with serve_default_model(str(cross_encoder[0]), tmp_path_factory.mktemp("srv"), "--runner", "pooling",
                             "--score-template", TEMPLATE, "--served-model-name", "ce") as s:
        yield s


def test_classify_equals_hf(server, cross_encoder):
    _, hf, tokenizer = cross_encoder
    ids = tokenizer(DOCS[1])["input_ids"]
    for path, inputs in (("/classify", [DOCS[0], DOCS[2]]), ("/v1/classify", [ids, ids[:3]])):
        r = server.post(path, {"model": "ce", "input": inputs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "ce"
        assert [(d["index"], d["label"], d["num_classes"]) for d in body["data"]] == [(0, "LABEL_0", 1), (1, "LABEL_0", 1)]
        assert [d["probs"][0] for d in body["data"]] == pytest.approx([hf(x) for x in inputs], abs=2e-5)
        lengths = [len(tokenizer(x)["input_ids"]) if isinstance(x, str) else len(x) for x in inputs]
        assert body["usage"]["prompt_tokens"] == sum(lengths)


def test_rerank_and_score_order_as_hf(server, cross_encoder):
    hf = cross_encoder[1]
    want = [hf(TEMPLATE.format(query=QUERY, document=d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    r = server.post("/v2/rerank", {"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == order[:2]
    assert [x["relevance_score"] for x in results] == pytest.approx([want[i] for i in order[:2]], abs=2e-5)
    r = server.post("/score", {"text_1": QUERY, "text_2": DOCS})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=2e-5)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/embeddings", {"input": "hi"}, "model"),
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": "x", "dimensions": 4}, "dimensions"),
    ("/classify", {"input": [[1, 2], [49152]]}, "prompt_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model.runner"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, field):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text
    assert server.post("/classify", {"input": "still serving"}).status_code == 200


def test_seeded_fuzz_no_5xx_no_leak(server):
    statuses = fuzz_endpoints(server, {
        "/classify": ({"input": "Hi"}, ["input", "add_special_tokens", "priority", "user", "bogus"]),
        "/score": ({"text_1": "a", "text_2": ["b", "c"]}, ["text_1", "text_2", "priority", "bogus"]),
        "/v1/rerank": ({"query": "q", "documents": ["a", "b"]}, ["query", "documents", "top_n", "return_documents"]),
    }, seed=20261203)
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses
