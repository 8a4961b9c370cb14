"""A checkpoint's own classification head (``*ForSequenceClassification``) under the pooling
runner, against HF transformers' ``*ForSequenceClassification`` on the same weights (float32):
tiny random Qwen2 (three labels, untied embeddings) and Llama (one label: a cross-encoder)
checkpoints with the default model's tokenizer (``helpers.tiny_classifier``). Probabilities
equal HF's logits put through softmax / sigmoid by hand under chunked prefill and the prefix
cache; ``LLM.score`` ranks as HF's scores do; the configuration errors name the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers.tiny_classifier import hf_logits, save_llama_cross_encoder, save_qwen2_classifier
from paged import LLM, PoolingParams
from paged.core.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.slow

ENGINE = dict(device="cpu", dtype="float32", attention="torch", runner="pooling", max_num_batched_tokens=16,
              block_size=8)
SHARED = "A long shared preamble about rivers, bridges and the old town, told twice over. "
TEXTS = [SHARED + "Paris is in France.", SHARED + "Bananas are yellow.", "hello", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def qwen2_classifier(tmp_path_factory, default_model_dir):
    """Three labels, untied embeddings (no lm_head in the checkpoint); the HF model and its tokenizer."""
    path = tmp_path_factory.mktemp("cls") / "qwen2-cls"
    model = save_qwen2_classifier(path, default_model_dir)
    return path, model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def llama_cross_encoder(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("cls") / "llama-ce"
    model = save_llama_cross_encoder(path, default_model_dir)
    return path, model, transformers.AutoTokenizer.from_pretrained(path)


def test_three_labels_equal_hf_softmax_under_chunking_and_the_prefix_cache(qwen2_classifier):
    path, model, tokenizer = qwen2_classifier
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.model_info.pooling["labels"] == ["negative", "neutral", "positive"]
    for round_ in range(2):  # the second round's shared preambles come from the prefix cache
        outputs = llm.classify(TEXTS, use_tqdm=False)
        for text, out in zip(TEXTS, outputs):
            expected = torch.softmax(hf_logits(model, tokenizer, text), 0).numpy()
            np.testing.assert_allclose(out.outputs.probs, expected, atol=2e-5, err_msg=f"round {round_}: {text!r}")
            assert out.outputs.score == pytest.approx(expected[2], abs=2e-5)
            assert len(out.prompt_token_ids) == len(tokenizer(text).input_ids)
    assert llm.engine.kv_cache_manager.prefix_cache_stats.hits > 0
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.encode(["x"], PoolingParams(dimensions=2), use_tqdm=False)


def test_a_cross_encoder_scores_as_hf_sigmoid_and_ranks_the_same(llama_cross_encoder):
    path, model, tokenizer = llama_cross_encoder
    template = "Query: {query}\nDocument: {document}"
    llm = LLM(str(path), score_template=template, **ENGINE)
    info = llm.engine.model_info.pooling
    assert (info["labels"], info["activation"]) == (["LABEL_0"], "sigmoid")
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "The Seine flows through Paris.",
                                      "def add(a, b): return a + b"]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    expected = [torch.sigmoid(hf_logits(model, tokenizer, template.format(query=query, document=d))[0]).item()
                for d in docs]
    assert scores == pytest.approx(expected, abs=2e-5)
    assert np.argsort(scores).tolist() == np.argsort(expected).tolist()
    with pytest.raises(InvalidRequestError, match="text_1: 2 texts for 4 in text_2"):
        llm.score(["a", "b"], docs, use_tqdm=False)


def test_an_embedding_model_refuses_classify(default_model_dir):
    llm = LLM(default_model_dir, **ENGINE)
    with pytest.raises(InvalidRequestError, match=r"model: this engine embeds \(no classifier\)"):
        llm.classify(["hi"], use_tqdm=False)


@pytest.mark.parametrize("settings, message", [
    (dict(runner="generate"), r"model.runner: 'generate', but .* is a sequence classifier \(architectures "
                              r"\['Qwen2ForSequenceClassification'\].*--runner pooling"),
    (dict(pooler="mean"), r"pooling.pooler: 'mean', but this checkpoint is a sequence classifier"),
    (dict(classifier_from_tokens=["no", "yes"]), r"pooling.classifier_from_tokens: \['no', 'yes'\], but this "
                                                 r"checkpoint is a sequence classifier"),
])
def test_configuration_errors_name_the_field(qwen2_classifier, settings, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(qwen2_classifier[0]), **{**ENGINE, **settings})


def test_a_cross_encoders_configured_activation_is_used(llama_cross_encoder, tmp_path):
    """sentence-transformers' CrossEncoder names its activation in config.json: Identity gives the raw logit."""
    import json
    import shutil

    path, model, tokenizer = llama_cross_encoder
    copy = tmp_path / "identity"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (copy / "config.json").write_text(json.dumps(config))
    llm = LLM(str(copy), **ENGINE)
    assert llm.engine.model_info.pooling["activation"] == "none"
    out = llm.classify(["Paris is in France."], use_tqdm=False)[0].outputs
    assert out.probs == pytest.approx([hf_logits(model, tokenizer, "Paris is in France.")[0].item()], abs=2e-5)
