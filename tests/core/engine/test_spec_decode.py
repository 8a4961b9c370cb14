"""Speculative decoding: the ``ngram`` proposer against a brute-force search, and the engine's
mechanism (scheduling the drafts, verifying them, rolling the KV cache back) against plain
decoding of the default model, which must give the same greedy tokens, logprobs and stop
handling, with chunked prefill, prefix caching, preemption and ``n > 1``; the KV cache ends with
every block free. The sampled distribution is checked against HF transformers' probabilities in
``test_spec_decode_distribution.py``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paged import LLM, SamplingParams
from paged.core import registry as registry_module
from paged.core.errors import ConfigError
from paged.core.hookspecs import SpeculativeProposerSpec, hookimpl
from paged.core.speculative import DraftRequest, TokenIds
from paged.plugins.ngram import NgramOptions, NgramProposer


class _Req:
    """The fields a DraftRequest reads."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids = request_id, tokens
        self.prompt_token_ids, self.output_token_ids = tokens[:3], tokens[3:]


def brute_force_ngram(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest n in [lo, hi] whose last-n suffix also ends at an earlier position; of those
    earlier positions the latest; the (up to k) tokens after it."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):  # an occurrence ending at `end` < length - 1
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:min(end + 1 + k, length)]
    return []


def test_ngram_hand_computed():
    proposer = NgramProposer(NgramOptions(prompt_lookup_min=2, prompt_lookup_max=3))
    tokens = [1, 2, 3, 4, 9, 2, 3]  # suffix (2, 3) ended at position 2: what followed is 4, 9, 2
    request = DraftRequest(_Req("a", tokens))
    assert proposer.propose([request], 3) == [[4, 9, 2]]
    tokens += [4]  # now (2, 3, 4) occurred at 1..3: 9, 2, 3, 4 followed it (up to the end of the sequence)
    assert proposer.propose([request], 5) == [[9, 2, 3, 4]]
    tokens += [7]  # (3, 4, 7) and (4, 7) never occurred before
    assert proposer.propose([request], 4) == [[]]
    proposer.forget(["a"])
    assert proposer._indexes == {}


@pytest.mark.parametrize("lo,hi", [(1, 1), (2, 4), (3, 5)])
def test_ngram_equals_brute_force_as_the_sequence_grows(lo, hi):
    """Sequences over a few symbols (many repeats) grow by 1-3 tokens a step, two requests
    interleaved; at every step the proposal is the brute-force search's."""
    rng = random.Random(lo * 10 + hi)
    proposer = NgramProposer(NgramOptions(prompt_lookup_min=lo, prompt_lookup_max=hi))
    sequences = {"x": [rng.randrange(4) for _ in range(5)], "y": [rng.randrange(6) for _ in range(2)]}
    views = {rid: DraftRequest(_Req(rid, ids)) for rid, ids in sequences.items()}
    for _ in range(150):
        for rid, ids in sequences.items():
            ids.extend(rng.randrange(4 if rid == "x" else 6) for _ in range(rng.randint(1, 3)))
        got = proposer.propose(list(views.values()), 4)
        assert got == [brute_force_ngram(ids, 4, lo, hi) for ids in sequences.values()]


def test_token_ids_view_is_read_only_and_live():
    ids = [1, 2, 3]
    view = TokenIds(ids)
    ids.append(4)
    assert len(view) == 4 and view[-1] == 4 and view[1:3] == [2, 3]
    view[0:2].append(9)  # a slice is a copy
    assert ids == [1, 2, 3, 4]
    with pytest.raises(TypeError):
        view[0] = 5


# ---- the engine -------------------------------------------------------------------------------

REPETITIVE = [
    "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    '{"name": "Ada", "age": 36, "city": "London"}\nRewrite the JSON above with the same keys: {"name":',
    "one two three four one two three four one two three",
    "The cat sat on the mat. The cat sat on the mat. The cat sat",
]
FREE = ["Tell me about the moon.", "What is the capital of France?", "Write a haiku about rain.",
        "Explain recursion to a child.", "List three colors."]


def _prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        base = (REPETITIVE if i % 2 == 0 else FREE)[(i // 2) % 5]
        out.append(base if i < 10 else f"{base} ({i})")
    return out


def _greedy(llm, prompts, **kw):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


# at every batch size (the default stops speculating above 8 decoding requests)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
         "disable_by_batch_size": None}
SMALL = dict(dtype="float32", max_num_batched_tokens=64, long_prefill_token_threshold=32, block_size=4)


@pytest.fixture(scope="module")
def plain_llm():
    with LLM(**SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain_outputs(plain_llm):
    return {"greedy": [o.outputs[0] for o in _greedy(plain_llm, _prompts(50), logprobs=2)]}


def test_greedy_tokens_and_logprobs_equal_plain_decoding(plain_outputs):
    """50 prompts (half of them copying their input), float32, 4-token prefill chunks of a
    64-token budget, prefix caching: the same tokens as without speculation, logprobs within
    1e-4 (the verification rows run through the same kernels as a chunk), most drafts of the
    copying prompts accepted; afterwards every KV block is free."""
    with LLM(speculative_config=NGRAM, **SMALL) as llm:
        outputs = [o.outputs[0] for o in _greedy(llm, _prompts(50), logprobs=2)]
        stats = llm.engine.core.speculator.stats
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    for i, (got, want) in enumerate(zip(outputs, plain_outputs["greedy"])):
        assert got.token_ids == want.token_ids, i
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.logprobs],
                                   atol=1e-4)
        assert [[t for t, _ in lp.top] for lp in got.logprobs] == [[t for t, _ in lp.top] for lp in want.logprobs]
    assert stats.num_draft_tokens > 100 and 0.3 < stats.acceptance_rate <= 1.0
    assert stats.mean_accepted_length > 1.5
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)  # position i needs i - 1


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": None}


def test_suffix_gives_the_plain_greedy_tokens_and_drafts_from_earlier_outputs(plain_outputs):
    """``suffix`` on 16 of the prompts, then on the same 16 again: plain decoding's tokens both
    times; the second pass finds the first pass's outputs in its cache, so it accepts more of
    its drafts (matched from the request's first token on) than the first did."""
    prompts = _prompts(16)
    want = [o.token_ids for o in plain_outputs["greedy"][:16]]
    with LLM(speculative_config=SUFFIX, **SMALL) as llm:
        first = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
        stats = llm.engine.core.speculator.stats
        accepted_first = stats.num_accepted_tokens
        second = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
        accepted_second = stats.num_accepted_tokens - accepted_first
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    assert first == want and second == want
    assert accepted_first > 0 and accepted_second > 1.5 * accepted_first


def test_the_model_as_its_own_draft_accepts_every_greedy_token(default_model_dir, tmp_path):
    """``draft_model`` with the target itself as the draft (a tiny random Llama in float32, its
    own 4-token KV blocks): every draft is the target's greedy token, so every one is accepted and
    the tokens are plain decoding's; the draft's cache is empty again once the requests end. A
    draft model of another vocabulary is refused before anything runs."""
    from helpers.tiny_llama import TINY, save_tiny_llama

    target = tmp_path / "tiny"
    save_tiny_llama(target, default_model_dir, **{**TINY, "max_position_embeddings": 256})
    settings = dict(model=str(target), quantization="none", **SMALL)
    prompts = [p[:40] for p in _prompts(6)]
    with LLM(**settings) as llm:
        plain = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
    draft = {"method": "draft_model", "model": str(target), "dtype": "float32", "block_size": 4,
             "num_speculative_tokens": 4, "disable_by_batch_size": None}
    with LLM(speculative_config=draft, **settings) as llm:
        outputs = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
        stats = llm.engine.core.speculator.stats
        proposer = llm.engine.core.speculator.proposer
        assert not proposer.requests and proposer.kv.num_free_blocks == proposer.kv.num_blocks
    assert outputs == plain
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    save_tiny_llama(tmp_path / "other-vocab", default_model_dir, **{**TINY, "vocab_size": 1000})
    with pytest.raises(ConfigError, match="the draft model .* has a vocabulary of 1000 tokens, the target 49152"):
        LLM(speculative_config={**draft, "model": str(tmp_path / "other-vocab")}, **settings)


class _ScriptedProposer:
    """Drafts from a script: the true greedy continuation with some tokens replaced by wrong
    ones (so that every acceptance length occurs), or garbage."""

    script: dict[tuple[int, ...], list[int]] = {}
    rng = random.Random(0)
    calls = 0

    def __init__(self, options, context) -> None:
        self.vocab = context.vocab_size

    def propose(self, requests, num_tokens):
        type(self).calls += 1
        out = []
        for r in requests:
            truth = self.script.get(tuple(r.token_ids[:r.num_prompt_tokens]), [])[r.num_output_tokens:]
            draft = list(truth[:num_tokens + 2])  # longer than asked: the engine cuts it
            draft += [self.rng.randrange(self.vocab) for _ in range(num_tokens + 2 - len(draft))]  # past the end too
            for j in range(len(draft)):
                if self.rng.random() < 0.25:
                    draft[j] = self.rng.randrange(self.vocab)
            out.append(draft if self.rng.random() < 0.9 else [])
        return out

    def forget(self, request_ids):
        pass


class _ScriptedPlugin:
    @staticmethod
    @hookimpl
    def register_speculative_proposers():
        return [SpeculativeProposerSpec("scripted", _ScriptedProposer)]


@pytest.fixture
def scripted(monkeypatch):
    registry = registry_module.load_plugins(modules=[("scripted", _ScriptedPlugin)])
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)
    return _ScriptedProposer


def test_random_accept_and_reject_with_preemption_prefix_caching_and_n(scripted, plain_llm, plain_outputs):
    """A proposer whose drafts are right or wrong at random positions (every acceptance length
    from 0 to k), 6 drafts a step, at every batch size, a KV cache of 40 blocks of 4 (requests preempt each other and
    recompute), prefix caching, n = 2, stop strings: the same tokens as plain decoding; no block
    leaks; the prefix cache never holds a block of rejected drafts (a repeated prompt, served
    from it, gives the same tokens)."""
    prompts = _prompts(8)
    tokenizer = plain_llm.tokenizer
    scripted.script = {tuple(tokenizer(p)["input_ids"]): out.token_ids for p, out in zip(prompts, plain_outputs["greedy"])}
    stop_plain = _greedy(plain_llm, prompts[:4], stop=[" the", "b"])
    spec = {"method": "scripted", "num_speculative_tokens": 6, "disable_by_batch_size": None}
    with LLM(speculative_config=spec, num_kv_blocks=40, **SMALL) as llm:
        outputs = _greedy(llm, prompts, n=2)
        preemptions = llm.engine.core.snapshot_stats().num_preemptions
        again = _greedy(llm, prompts[:3])
        hits = llm.engine.kv_cache_manager.prefix_cache_stats.hits
        stop_spec = _greedy(llm, prompts[:4], stop=[" the", "b"])
        stats = llm.engine.core.speculator.stats
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    for prompt, out in zip(prompts, outputs):
        want = scripted.script[tuple(tokenizer(prompt)["input_ids"])]
        assert [c.token_ids for c in out.outputs] == [want, want], prompt
    for prompt, out in zip(prompts, again):
        assert out.outputs[0].token_ids == scripted.script[tuple(tokenizer(prompt)["input_ids"])]
    for a, b in zip(stop_spec, stop_plain):
        assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason) == \
            (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason)
    assert preemptions > 0 and hits > 0
    assert len(stats.accepted_per_position) == 6 and 0 < stats.accepted_per_position[5] < stats.accepted_per_position[0]
    assert stats.num_accepted_tokens < stats.num_draft_tokens


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "city": {"enum": ["London", "Paris"]}},
          "required": ["name", "age", "city"]}
CONSTRAINED = [
    ('{"name": "Ada", "age": 36, "city": "London"}\nRewrite the JSON above with the same keys: ', {"json_schema": SCHEMA}),
    ("Copy this list exactly: apple, banana, cherry, apple, banana, cherry. Now:", {"regex": r"( ?(apple|banana|cherry),){3,6}"}),
    ("The cat sat on the mat. The cat sat on the mat. Where did the cat sit?", {"choice": ["on the mat", "on the sofa"]}),
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", {"regex": r"    return [a-z] [-+*] [a-z]\n"}),
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constrained_requests_speculate_on_drafts_their_grammar_allows(scripted, plain_llm, backend):
    """Structured outputs under speculation, on each grammar backend: drafts are cut at the first
    token the grammar refuses (the scripted drafts hold random tokens a grammar refuses, also
    past the end of the output), each verification row is masked by the grammar after the drafts
    before it, and the accepted tokens advance it. Greedy: plain decoding's constrained tokens,
    beside an unconstrained request; a sampled constrained request gives a valid output; every
    block is free at the end."""
    import json
    import re

    import jsonschema

    prompts = [p for p, _ in CONSTRAINED] + [FREE[0]]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_output=c) for _, c in CONSTRAINED]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    settings = {**SMALL, "structured_output": {"backend": backend}}
    if backend == "xgrammar":  # the default: the module's plain engine
        expected = [o.outputs[0] for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    else:
        with LLM(**settings) as plain:
            expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    tokenizer = plain_llm.tokenizer
    scripted.script = {tuple(tokenizer(p)["input_ids"]): o.token_ids for p, o in zip(prompts, expected)}
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_output={"json_schema": SCHEMA})
    spec = {"method": "scripted", "num_speculative_tokens": 6, "disable_by_batch_size": None}
    with LLM(speculative_config=spec, **settings) as llm:
        outputs = [o.outputs[0] for o in llm.generate(prompts + [prompts[0]], params + [sampled], use_tqdm=False)]
        stats = llm.engine.core.speculator.stats
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    for got, want in zip(outputs, expected):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert [o.finish_reason for o in outputs[:4]] == ["stop"] * 4
    jsonschema.validate(json.loads(outputs[0].text), SCHEMA)
    jsonschema.validate(json.loads(outputs[-1].text), SCHEMA)
    assert re.fullmatch(r"( ?(apple|banana|cherry),){3,6}", outputs[1].text)
    assert outputs[2].text in ("on the mat", "on the sofa")
    assert stats.num_accepted_tokens > 30 and stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_drafts_are_cut_where_the_grammar_refuses_and_the_matcher_is_left_where_it_was(plain_llm, backend):
    """On each backend's matcher: a draft is kept up to the first refused token, the matcher
    takes no step, and ``GrammarAfterDrafts`` masks as the matcher does after those drafts."""
    import torch

    from paged.backends.llguidance_backend import LLGuidanceBackend
    from paged.backends.xgrammar_backend import XGrammarBackend
    from paged.core.engine.plugin_faults import PluginCode
    from paged.core.engine.request import Request
    from paged.core.engine.spec_decode import GrammarAfterDrafts, Speculator
    from paged.core.structured_output import StructuredOutputParams

    tokenizer = plain_llm.tokenizer
    eos = tokenizer.eos_token_id
    factory = XGrammarBackend if backend == "xgrammar" else LLGuidanceBackend
    grammar_backend = factory(tokenizer, 49152, [eos], None)
    compiled = grammar_backend.compile(StructuredOutputParams(regex="(ab)+c"))

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def mask(matcher):
        bitmask = torch.zeros(1, 49152 // 32, dtype=torch.int32)
        matcher.fill_bitmask(bitmask, 0)
        return bitmask

    good, bad = ids("a") + ids("b") + ids("a"), ids("x")
    request = Request("r", [1, 2], SamplingParams(max_tokens=20))
    request.grammar = grammar_backend.matcher(compiled)
    start = mask(request.grammar)
    speculator = Speculator(None, PluginCode("speculative proposer", "t", None, frozenset()), "t", 8, 49152, 512)
    assert speculator._grammar_prefix(request, good + bad + good) == good
    assert torch.equal(mask(request.grammar), start)
    after = grammar_backend.matcher(compiled)
    for token in good:
        assert after.accept_token(token)
    view = GrammarAfterDrafts(request.grammar, good)
    bitmask = torch.zeros(2, 49152 // 32, dtype=torch.int32)
    view.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[1:], mask(after)) and not torch.equal(bitmask[1:], start)
    assert torch.equal(mask(request.grammar), start) and not view.is_terminated()
    complete = good + ids("b") + ids("c")  # "ababc": only a stop token may follow
    assert speculator._grammar_prefix(request, complete + bad + [eos]) == complete
    assert torch.equal(mask(request.grammar), start)
    ended = complete + [eos]
    assert speculator._grammar_prefix(request, ended + bad) == ended + bad  # past the end nothing is checked
    assert GrammarAfterDrafts(request.grammar, ended).is_terminated() and torch.equal(mask(request.grammar), start)


def test_the_config_as_vllm_takes_it_and_its_errors(tmp_path):
    from paged.core.cli.flags import add_engine_flags, engine_config_from_args
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_max": 5, "prompt_lookup_min": 1}'])
    config = engine_config_from_args(args)
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 3
    assert config.speculative.options == {"prompt_lookup_max": 5, "prompt_lookup_min": 1}
    from paged.core.config import load_config
    from paged.core.frontend.llm import settings_to_overrides

    config_file = tmp_path / "paged.toml"
    config_file.write_text('[speculative]\nmethod = "ngram"\n')
    assert load_config(str(config_file), {}).speculative.method == "ngram"
    assert load_config(str(config_file), settings_to_overrides({"speculative_config": None})).speculative.method is None
    with pytest.raises(ConfigError, match="--speculative-config: not JSON"):
        engine_config_from_args(parser.parse_args(["--speculative-config", "{method: ngram}"]))
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        engine_config_from_args(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']))
    with pytest.raises(ConfigError, match=r"speculative.method: unknown value 'ngrams'. Did you mean 'ngram'\?"):
        LLM(speculative_config={"method": "ngrams"})
    with pytest.raises(ConfigError, match=r"(?s)speculative.options.prompt_lookup_mx: unknown setting.*accepts: prompt_lookup_min"):
        LLM(speculative_config={"method": "ngram", "prompt_lookup_mx": 3})
    with pytest.raises(ConfigError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"):
        LLM(speculative_config={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ConfigError, match=r"(?s)speculative.options.suffix_decoding_max_spec_factr: unknown setting"
                       r".*accepts: suffix_decoding_max_spec_factor \(default 1.0\), suffix_decoding_max_cached_requests"):
        LLM(speculative_config={"method": "suffix", "suffix_decoding_max_spec_factr": 2})


@pytest.mark.slow
def test_two_tensor_parallel_ranks_verify_as_one(plain_outputs):
    """TP = 2 (gloo): rank 0 schedules, samples and verifies; every rank runs the 1 + k token
    verification forwards. The greedy tokens of 6 prompts are those of plain decoding."""
    prompts = _prompts(6)
    with LLM(speculative_config=NGRAM, tensor_parallel_size=2, **SMALL) as llm:
        outputs = _greedy(llm, prompts)
        accepted = llm.engine.core.speculator.stats.num_accepted_tokens
    assert [o.outputs[0].token_ids for o in outputs] == [o.token_ids for o in plain_outputs["greedy"][:6]]
    assert accepted > 0
