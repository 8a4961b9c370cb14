"""The pooling runner (``runner="pooling"``) against HF transformers on the default model's
weights (float32): embeddings from each bundled pooler equal HF's final hidden states pooled by
hand (cosine >= 0.9999) under chunked prefill, the prefix cache and preemption; the
sentence-transformers configuration picks the pooler; a classifier's score and a bi-encoder's
score equal the same computed from HF's outputs; Matryoshka dimensions; a pooler plugin, a broken
one, and the configuration errors, each naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from paged import LLM, PoolingParams
from paged.core import registry as registry_module
from paged.core.errors import ConfigError, EngineError, InvalidRequestError
from paged.core.hookspecs import PoolerSpec, hookimpl

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is Paris, a city on the Seine with many museums and old bridges.",
    "hello world",
    "def add(a, b):\n    return a + b",
    "Bananas are yellow.",
]
ENGINE = dict(device="cpu", dtype="float32", attention="torch", runner="pooling", max_num_batched_tokens=16,
              block_size=8)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    """Text -> HF's final hidden states [P, H] and LM-head logits [P, vocab] (one text at a time)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def run(text: str):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model(ids, output_hidden_states=True)
        return out.hidden_states[-1][0].double(), out.logits[0].double()

    return run


POOL = {"last": lambda h: h[-1], "mean": lambda h: h.mean(0), "cls": lambda h: h[0], "max": lambda h: h.amax(0)}


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def assert_embeds_like_hf(outputs, texts, hf, pooler: str, normalize: bool = True) -> None:
    for text, out in zip(texts, outputs):
        want = POOL[pooler](hf(text)[0]).numpy()
        got = np.asarray(out.outputs.embedding, dtype=np.float64)
        assert got.shape == want.shape
        assert float(unit(got) @ unit(want)) >= 0.9999, (pooler, text)
        if normalize:
            assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
            np.testing.assert_allclose(got, unit(want), atol=2e-4)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)


def test_two_tensor_parallel_ranks_pool_and_classify_as_hf(default_model_dir, hf):
    """TP = 2 (gloo): rank 0 pools the replicated post-norm hidden states; the classifier's two
    token rows go through the sharded LM head on both ranks, as sampled rows do."""
    with LLM(default_model_dir, pooler="mean", tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.engine.core.tp_ranks is not None  # a second rank runs
        assert_embeds_like_hf(llm.embed(TEXTS, use_tqdm=False), TEXTS, hf, "mean")
    template = "Query: {query}\nDocument: {document}\nRelevant:"
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow."]
    with LLM(default_model_dir, classifier_from_tokens=["no", "yes"], score_template=template,
             tensor_parallel_size=2, **ENGINE) as llm:
        no, yes = (llm.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("no", "yes"))
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    for doc, got in zip(docs, scores):
        logits = hf(template.replace("{query}", query).replace("{document}", doc))[1][-1]
        assert got == pytest.approx(torch.softmax(logits[[no, yes]], 0)[1].item(), abs=1e-5)


@pytest.mark.parametrize("pooler", ["last", "mean"])
def test_embeddings_equal_hf_under_chunking_and_the_prefix_cache(default_model_dir, hf, pooler):
    llm = LLM(default_model_dir, pooler=pooler, **ENGINE)
    kv = llm.engine.kv_cache_manager
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert_embeds_like_hf(outputs, TEXTS, hf, pooler)
    assert [len(o.prompt_token_ids) for o in outputs] == [len(llm.tokenizer(t)["input_ids"]) for t in TEXTS]
    hits = kv.prefix_cache_stats.hits
    again = llm.embed([TEXTS[0], TEXTS[0] + " And more."], PoolingParams(normalize=False), use_tqdm=False)
    assert_embeds_like_hf(again, [TEXTS[0], TEXTS[0] + " And more."], hf, pooler, normalize=False)
    # last-token pooling reads one row: the cached prompt is reused; mean reads every row: it is not
    assert (kv.prefix_cache_stats.hits > hits) == (pooler == "last")
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(InvalidRequestError, match="model.runner: this engine pools"):
        llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions: 8 asked for, but this model has no Matryoshka"):
        llm.embed(["hi"], PoolingParams(dimensions=8), use_tqdm=False)


def test_preempted_requests_pool_every_row_once(default_model_dir, hf):
    # 7 blocks of 8 tokens; 8-token chunks of two prompts a step, each prompt 30-50 tokens: a prompt
    # needing its next block preempts another mid-prefill
    llm = LLM(default_model_dir, pooler="max", num_kv_blocks=7, max_num_seqs=8, long_prefill_token_threshold=8,
              **ENGINE)
    tail = " Then the story goes on for a while, with more words and more tokens in every sentence of it."
    texts = [t + tail for t in TEXTS]
    outputs = llm.embed(texts, use_tqdm=False)
    assert llm.engine.core.snapshot_stats().num_preemptions > 0
    assert_embeds_like_hf(outputs, texts, hf, "max")
    assert not llm.engine.core.runner.pooling_rows.rows


def test_sentence_transformers_config_picks_the_pooler(default_model_dir, hf, tmp_path):
    model_dir = tmp_path / "st"
    model_dir.mkdir()
    for f in Path(default_model_dir).iterdir():
        (model_dir / f.name).symlink_to(f)
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 576, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    llm = LLM(str(model_dir), **ENGINE)  # pooler auto; no Normalize module: not normalised
    assert llm.engine.model_info.pooling["pooler"] == "cls" and llm.engine.model_info.pooling["normalize"] is False
    assert_embeds_like_hf(llm.embed(TEXTS[:2], use_tqdm=False), TEXTS[:2], hf, "cls", normalize=False)
    llm.shutdown()
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ConfigError, match=r"pooling.pooler: the checkpoint's sentence-transformers module "
                                          r"'sentence_transformers.models.Dense' \(2_Dense\) is not supported"):
        LLM(str(model_dir), **ENGINE)


def test_scores_classifier_and_bi_encoder_and_dimensions(default_model_dir, hf):
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "The Seine flows through Paris."]
    template = "Query: {query}\nDocument: {document}\nRelevant:"
    llm = LLM(default_model_dir, classifier_from_tokens=["no", "yes"], score_template=template, **ENGINE)
    no, yes = (llm.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("no", "yes"))
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    for doc, got in zip(docs, scores):
        logits = hf(template.replace("{query}", query).replace("{document}", doc))[1][-1]
        assert got == pytest.approx(torch.softmax(logits[[no, yes]], 0)[1].item(), abs=1e-5)
    with pytest.raises(InvalidRequestError, match="text_1: 2 texts for 3 in text_2"):
        llm.score(["a", "b"], docs, use_tqdm=False)
    llm.shutdown()

    llm = LLM(default_model_dir, pooling_max_dimensions=64, **ENGINE)
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    q = unit(hf(query)[0][-1].numpy())
    assert scores == pytest.approx([float(q @ unit(hf(d)[0][-1].numpy())) for d in docs], abs=1e-4)
    short = llm.embed([docs[0]], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(short, unit(hf(docs[0])[0][-1].numpy()[:32]), atol=2e-4)
    with pytest.raises(InvalidRequestError, match="dimensions: 65 exceeds this model's 64"):
        llm.embed([docs[0]], PoolingParams(dimensions=65), use_tqdm=False)


class FirstAndLast:
    """A plugin pooler: the first and last rows side by side (2 x hidden)."""

    needs_all_tokens = True

    def __init__(self, options, context) -> None:
        self.hidden = context.hidden_size

    def pool(self, hidden_states):
        return [torch.cat([h[0], h[-1]]) for h in hidden_states]


class WrongShape(FirstAndLast):
    def pool(self, hidden_states):
        return [h for h in hidden_states]  # 2-d: breaks the contract


class PoolerPlugin:
    @staticmethod
    @hookimpl
    def register_poolers():
        return [PoolerSpec("first-and-last", FirstAndLast), PoolerSpec("wrong-shape", WrongShape)]


def test_a_pooler_plugin_runs_and_a_broken_one_is_named(default_model_dir, hf, monkeypatch):
    registry = registry_module.load_plugins(modules=[("pooler-plugin", PoolerPlugin)])
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)
    llm = LLM(default_model_dir, pooler="first-and-last", pooling_normalize=False, **ENGINE)
    out = llm.embed([TEXTS[0]], use_tqdm=False)[0].outputs.data
    h = hf(TEXTS[0])[0].numpy()
    np.testing.assert_allclose(out, np.concatenate([h[0], h[-1]]), rtol=1e-3, atol=2e-3)
    llm.shutdown()
    llm = LLM(default_model_dir, pooler="wrong-shape", **ENGINE)
    with pytest.raises(EngineError, match="pooler 'wrong-shape': pool\\(\\) must return one 1-d tensor per request"):
        llm.embed(["hi"], use_tqdm=False)


@pytest.mark.parametrize("settings, message", [
    (dict(pooler="avg"), r"pooling.pooler: unknown value 'avg'.*Available: cls, last, max, mean"),
    (dict(speculative_config={"method": "ngram"}), r"speculative.method: 'ngram' cannot run with model.runner=pooling"),
    (dict(classifier_from_tokens=["no", "maybe so"]), r"pooling.classifier_from_tokens: 'maybe so' is \d+ tokens"),
    (dict(score_template="{query} only"), r"score_template.*must contain \{document\}"),
])
def test_configuration_errors_name_the_field(default_model_dir, settings, message):
    with pytest.raises(ConfigError, match=message):
        LLM(default_model_dir, **{**ENGINE, **settings})
