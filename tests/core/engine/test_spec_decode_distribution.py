"""Sampled outputs with speculative decoding follow the model's own distribution.

A tiny random Llama (the default model's tokenizer) samples 4 tokens at temperature 0.8 among 3
allowed tokens, 3000 times (one seed each), while a proposer guesses 3 tokens a step uniformly
among those 3 and one forbidden token (so drafts are accepted, rejected and resampled at every
position). The reference is independent of paged: the exact probability of each of the 81
four-token outputs, from HF transformers' logits on the same weights (restricted to the allowed
tokens, divided by the temperature, softmaxed, multiplied along the sequence). A chi-square test
at p = 0.001 (outputs expected fewer than 5 times pooled) must accept; the same counts with the verification wrong (every draft accepted)
would fail it, which the test checks too."""

from __future__ import annotations

import itertools
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from paged import LLM, SamplingParams
from paged.core import registry as registry_module
from paged.core.hookspecs import SpeculativeProposerSpec, hookimpl

ALLOWED = [1000, 2000, 3000]
FORBIDDEN = 5000
TEMPERATURE = 0.8
NUM_SAMPLES = 3000
NEW_TOKENS = 4


class _UniformGuess:
    def __init__(self, options, context) -> None:
        self.rng = random.Random(1)

    def propose(self, requests, num_tokens):
        return [[self.rng.choice(ALLOWED + [FORBIDDEN]) for _ in range(num_tokens)] for _ in requests]

    def forget(self, request_ids):
        pass


class _Plugin:
    @staticmethod
    @hookimpl
    def register_speculative_proposers():
        return [SpeculativeProposerSpec("uniform-guess", _UniformGuess)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # logits of a few units: the allowed tokens' probabilities differ and depend on context
        hf.lm_head.weight.mul_(3.0)
    hf.save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, path / f.name)
    return hf, path


@torch.no_grad()
def exact_probabilities(hf, prompt: list[int]) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(ALLOWED, repeat=NEW_TOKENS):
        ids = prompt + list(seq)
        logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1:-1][:, ALLOWED].double() / TEMPERATURE
        probs = torch.softmax(logits, dim=-1)
        out[seq] = float(np.prod([probs[j, ALLOWED.index(t)] for j, t in enumerate(seq)]))
    return out


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """The chi-square quantile at the normal quantile ``z`` (3.0902: p = 0.999), Wilson and
    Hilferty's approximation (within 0.5% for dof >= 30)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * a ** 0.5) ** 3


def chi_square(counts: dict, expected: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; the outputs expected fewer than 5 times
    are pooled into one cell."""
    cells = [(counts.get(seq, 0), n * p) for seq, p in expected.items() if n * p >= 5]
    rare = [(counts.get(seq, 0), n * p) for seq, p in expected.items() if n * p < 5]
    if rare:
        cells.append((sum(c for c, _ in rare), sum(e for _, e in rare)))
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


@pytest.mark.slow
def test_sampled_outputs_follow_the_models_distribution(tiny, monkeypatch):
    hf, path = tiny
    registry = registry_module.load_plugins(modules=[("uniform-guess", _Plugin)])
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)
    prompt = [11, 22, 33, 44]
    expected = exact_probabilities(hf, prompt)
    assert max(expected.values()) < 0.2 and sum(p * NUM_SAMPLES >= 5 for p in expected.values()) > 30  # spread
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, ignore_eos=True, seed=i,
                             allowed_token_ids=ALLOWED) for i in range(NUM_SAMPLES)]
    spec = {"method": "uniform-guess", "num_speculative_tokens": 3, "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0}
    with LLM(str(path), dtype="float32", attention="torch", speculative_config=spec, max_num_seqs=256,
             enable_prefix_caching=True) as llm:
        outputs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
        stats = llm.engine.core.speculator.stats
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        seq = tuple(out.outputs[0].token_ids)
        counts[seq] = counts.get(seq, 0) + 1
    assert sum(counts.values()) == NUM_SAMPLES and set(counts) <= set(expected)
    stat, dof = chi_square(counts, expected, NUM_SAMPLES)
    assert dof > 30 and stat < chi2_critical(dof), (stat, dof)
    # drafts were accepted and rejected at each position: the test exercised both branches
    assert 0.1 < stats.acceptance_rate < 0.6 and stats.accepted_per_position[1] > 100
    assert len(stats.accepted_per_position) >= 2
    # what "accept every draft" would have produced instead: the first token as sampled, then the
    # proposer's uniform guesses (among the allowed ones) -- the test must be able to tell
    rng = random.Random(2)
    wrong = {}
    for out in outputs:
        seq = (out.outputs[0].token_ids[0], *(rng.choice(ALLOWED) for _ in range(NEW_TOKENS - 1)))
        wrong[seq] = wrong.get(seq, 0) + 1
    assert chi_square(wrong, expected, NUM_SAMPLES)[0] > chi2_critical(dof)
