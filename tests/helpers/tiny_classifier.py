"""Tiny random ``*ForSequenceClassification`` checkpoints with the default model's tokenizer (its
vocabulary is 49152), saved by HF transformers, and HF's logits on them (the independent
reference for the pooling runner's classification head)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

TINY = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}


def _save(model, path: Path, default_model_dir: str | Path):
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # spread the logits so that the probabilities differ
    model.save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, Path(path) / f.name)
    return model


def save_qwen2_classifier(path: Path, default_model_dir: str | Path):
    """Three labels (``SENTIMENT``), untied embeddings: the checkpoint has no lm_head (seed 0)."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False, num_labels=3, id2label=SENTIMENT,
                                      label2id={v: k for k, v in SENTIMENT.items()})
    return _save(transformers.Qwen2ForSequenceClassification(config).float().eval(), path, default_model_dir)


def save_llama_cross_encoder(path: Path, default_model_dir: str | Path):
    """One label (a cross-encoder's relevance logit), tied embeddings (seed 1)."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True, num_labels=1)
    return _save(transformers.LlamaForSequenceClassification(config).float().eval(), path, default_model_dir)


def hf_logits(model, tokenizer, text_or_ids) -> torch.Tensor:
    """HF's logits for one prompt (no padding), float64."""
    ids = tokenizer(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else list(text_or_ids)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].double()
