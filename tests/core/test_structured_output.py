"""Structured outputs: the grammar backends against brute force, the batched mask in the sampler,
and the engine (mixed batches, reproducibility, preemption, length, bad input) on a tiny model."""

import json
import re

import jsonschema
import pytest
import torch
from helpers.tiny_llama import save_tiny_llama

from paged.core.errors import InvalidRequestError
from paged.core.sampling_params import SamplingParams
from paged.core.structured_output import StructuredOutputParams as SO

BACKENDS = ["xgrammar", "llguidance"]


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from paged.core.loading.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def backends(tokenizer):
    from paged.backends.llguidance_backend import LLGuidanceBackend
    from paged.backends.xgrammar_backend import XGrammarBackend

    eos = [tokenizer.eos_token_id]
    return {"xgrammar": XGrammarBackend(tokenizer, 49152, eos, None), "llguidance": LLGuidanceBackend(tokenizer, 49152, eos, None)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """A random-weight 1-layer Llama (hidden 32) with the default model's tokenizer, fp32."""
    path = tmp_path_factory.mktemp("tiny-structured")
    save_tiny_llama(path, default_model_dir, vocab_size=49152, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    return str(path)


def make_llm(model, backend="xgrammar", **settings):
    from paged.core.frontend.llm import LLM

    kw = dict(device="cpu", attention="torch", max_model_len=512, num_kv_blocks=64, max_num_seqs=8)
    kw.update(settings)
    return LLM(model, structured_output={"backend": backend}, **kw)


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request, tiny_model):
    llm = make_llm(tiny_model, request.param)
    yield llm
    llm.shutdown()


def allowed_tokens(matcher) -> set[int]:
    bitmask = torch.zeros(1, 49152 // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


# --- backends against brute force ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_choice_mask_is_exactly_the_tokens_that_start_a_choice(backends, tokenizer, backend):
    choices = ["yes", "no", "maybe so"]
    matcher = backends[backend].matcher(backends[backend].compile(SO(choice=choices)))
    text = {t: tokenizer.decode([t]) for t in range(len(tokenizer))}
    expected = {t for t, s in text.items() if s and any(c.startswith(s) for c in choices) and t not in tokenizer.all_special_ids}
    assert allowed_tokens(matcher) == expected
    # after "may": only the tokens that continue "be so" (brute force again)
    for t in tokenizer("may", add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t)
    expected = {t for t, s in text.items() if s and "be so".startswith(s) and t not in tokenizer.all_special_ids}
    if backend == "xgrammar":
        assert allowed_tokens(matcher) == expected
    else:  # llguidance allows only the canonical tokens of a forced continuation ("be", not "b")
        assert allowed_tokens(matcher) and allowed_tokens(matcher) <= expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_accepts_valid_json_refuses_invalid_and_rolls_back(backends, tokenizer, backend):
    b = backends[backend]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    matcher = b.matcher(b.compile(SO(json_schema=schema)))
    ids = tokenizer(json.dumps({"a": 12, "b": "y"}), add_special_tokens=False)["input_ids"]
    masks = []
    for t in ids:
        masks.append(allowed_tokens(matcher))
        assert t in masks[-1]
        assert matcher.accept_token(t)
    assert allowed_tokens(matcher) == {tokenizer.eos_token_id}  # complete: only EOS is left
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.rollback(1)  # EOS taken back (speculation does this): complete again, not ended
    assert not matcher.is_terminated() and allowed_tokens(matcher) == {tokenizer.eos_token_id}
    matcher.rollback(3)
    assert allowed_tokens(matcher) == masks[-3]
    wrong = tokenizer('"z"', add_special_tokens=False)["input_ids"][0]
    assert wrong not in masks[-3] and not matcher.accept_token(wrong)
    matcher.reset()
    assert allowed_tokens(matcher) == masks[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_constraints_are_value_errors_naming_the_field(backend):
    from paged.core.registry import get_registry

    spec = get_registry().structured_output_backend(backend)
    for params, field in [(SO(regex="(ab"), "regex"), (SO(json_schema={"type": "nonsense"}), "json_schema")]:
        with pytest.raises(ValueError, match=rf"structured_output\.{field}"):
            spec.validate(params, None)


def test_params_validation_and_wire_round_trip():
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        SO(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        SO()
    with pytest.raises(InvalidRequestError, match="structured_output.choice"):
        SO(choice=[])
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output={"regex": "a+"})
    with pytest.raises(InvalidRequestError, match="unknown field"):
        SamplingParams(structured_output={"json": {}})
    from paged.core.ipc.engine_core_proc import AddRequest, make_encoder, request_decoder

    params = SamplingParams(structured_output={"json_schema": {"type": "object", "properties": {"x": {"type": "string"}}}})
    wire = make_encoder().encode(AddRequest("r", [1, 2], params, 0.0))
    back = request_decoder().decode(wire)
    assert back.sampling_params.structured_output == params.structured_output
    assert SO(json_schema={"b": 1, "a": 2}).cache_key() == SO(json_schema={"a": 2, "b": 1}).cache_key()


# --- the sampler's batched mask ------------------------------------------------------------------
class _Req:
    def __init__(self, rid, params, grammar=None):
        self.request_id, self.sampling_params, self.grammar = rid, params, grammar
        self.output_token_ids, self.all_token_ids, self.eos_token_id = [], [1], 2


def test_sampler_masks_constrained_rows_only_and_composes_with_sampling(backends):
    from paged.core.engine.sampler import Sampler

    b = backends["xgrammar"]
    compiled = b.compile(SO(choice=["yes", "no"]))
    torch.manual_seed(1)
    logits = torch.randn(4, 49152)
    reqs = [
        _Req("g0", SamplingParams(temperature=0), b.matcher(compiled)),
        _Req("u1", SamplingParams(temperature=0)),
        _Req("s2", SamplingParams(temperature=1.3, top_p=0.9, seed=7, repetition_penalty=1.2), b.matcher(compiled)),
        _Req("s3", SamplingParams(temperature=0.7, seed=3)),
    ]
    allowed = sorted(allowed_tokens(b.matcher(compiled)))
    out = Sampler(49152, "cpu").sample(logits.clone(), reqs).token_ids
    # greedy constrained row = argmax over the allowed tokens (brute force)
    assert out[0] == allowed[int(logits[0, allowed].argmax())]
    assert out[2] in allowed
    # unconstrained rows: exactly what they get alone
    assert out[1] == Sampler(49152, "cpu").sample(logits[1:2].clone(), [reqs[1]]).token_ids[0]
    assert out[3] == Sampler(49152, "cpu").sample(logits[3:4].clone(), [_Req("s3", reqs[3].sampling_params)]).token_ids[0]
    # a seeded constrained row is reproducible
    again = Sampler(49152, "cpu").sample(logits[2:3].clone(), [_Req("s2", reqs[2].sampling_params, b.matcher(compiled))])
    assert again.token_ids[0] == out[2]


# --- the engine ----------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "color", "n"],
}


def test_mixed_batch_unconstrained_get_their_solo_tokens_constrained_valid_and_reproducible(llm):
    plain = [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0.9, seed=5, max_tokens=10)]
    constrained = [
        SamplingParams(temperature=0, max_tokens=40, structured_output={"json_schema": SCHEMA}),
        SamplingParams(temperature=0, max_tokens=12, structured_output={"regex": r"[0-9]{2}-[a-c]{3}"}),
        SamplingParams(temperature=0.8, seed=1, max_tokens=8, structured_output={"choice": ["alpha", "beta", "gamma"]}),
    ]
    prompts = ["Hello there", "Once upon a time", "JSON:", "Code:", "Pick:"]
    mixed = llm.generate(prompts, plain + constrained, use_tqdm=False)
    for i, params in enumerate(plain):
        solo = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0]
        assert mixed[i].outputs[0].token_ids == solo.token_ids
    text = [o.outputs[0].text for o in mixed]
    jsonschema.validate(json.loads(text[2]), SCHEMA)
    assert re.fullmatch(r"[0-9]{2}-[a-c]{3}", text[3])
    assert text[4] in ("alpha", "beta", "gamma")
    assert all(o.outputs[0].finish_reason == "stop" for o in mixed[2:])
    again = llm.generate(prompts[2:], constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in mixed[2:]]


def test_grammar_that_cannot_end_in_time_finishes_with_length(llm):
    out = llm.generate(["Letters:"], SamplingParams(temperature=0, max_tokens=4,
                                                     structured_output={"regex": "[a-z]{300}"}), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert re.fullmatch("[a-z]+", out.outputs[0].text) and len(out.outputs[0].token_ids) == 4


def test_bad_constraint_is_rejected_before_queueing_and_others_go_on(llm):
    with pytest.raises(InvalidRequestError, match=r"structured_output\.regex"):
        llm.generate(["x"], SamplingParams(structured_output={"regex": "(unclosed"}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"structured_output\.json_schema"):
        llm.generate(["x"], SamplingParams(structured_output={"json_schema": {"type": 5}}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Pick:"], SamplingParams(max_tokens=5, structured_output={"choice": ["a1", "b2"]}), use_tqdm=False)
    assert out[0].outputs[0].text in ("a1", "b2")


def test_compile_failure_in_the_core_ends_only_that_request(tiny_model):
    from paged.core.engine.request import Request

    llm = make_llm(tiny_model)
    try:
        core = llm.engine.core
        # Bypass the front-end's check: the core's compile fails, the request ends with "error"
        # and a message naming the backend.
        core.add_request(Request("bad", [1, 2, 3], SamplingParams(structured_output={"regex": "(x"})))
        core.add_request(Request("good", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3)))
        finished, errors = {}, {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finish_reason:
                    finished[out.request_id], errors[out.request_id] = out.finish_reason, out.error
        assert finished == {"bad": "error", "good": "length"}
        assert errors["bad"].startswith("structured-output backend 'xgrammar' (plugin 'structured_output') raised in "
                                        "compile: ValueError: structured_output.regex: xgrammar cannot compile it")
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_preempted_constrained_requests_replay_to_the_same_tokens(tiny_model, backend):
    params = [SamplingParams(temperature=0, max_tokens=40, structured_output={"json_schema": SCHEMA}),
              SamplingParams(temperature=0.7, seed=11, max_tokens=40, structured_output={"json_schema": SCHEMA}),
              SamplingParams(temperature=0, max_tokens=40, structured_output={"regex": "([a-z]{4} ){6}"})]
    prompts = [f"Prompt number {i} is long enough to take a few blocks of the cache " * 2 for i in range(3)]
    roomy = make_llm(tiny_model, backend)
    try:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    finally:
        roomy.shutdown()
    tight = make_llm(tiny_model, backend, num_kv_blocks=8, block_size=16)
    try:
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.core.stats.num_preemptions > 0
    finally:
        tight.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_paged_run_structured_flags(tiny_model, tmp_path, capsys):
    from paged.core.cli.main import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    common = ["run", "-q", "--json", "--model", tiny_model, "--device", "cpu", "--attention", "torch",
              "--max-model-len", "256", "--num-kv-blocks", "32", "--max-tokens", "40"]
    assert main(common + ["--json-schema", str(schema), "JSON:"]) == 0
    jsonschema.validate(json.loads(json.loads(capsys.readouterr().out)["requests"][0]["text"]), SCHEMA)
    assert main(common + ["--structured-output-backend", "llguidance", "--choice", "up", "--choice", "down", "Go"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"][0]["text"] in ("up", "down")
    assert main(common + ["--regex", "(x", "Hi"]) == 2
    assert "structured_output.regex" in capsys.readouterr().err
    assert main(common + ["--regex", "a", "--choice", "b", "Hi"]) == 2
    assert "at most one of" in capsys.readouterr().err


# --- the front-end's check before queueing (paged.core.constraint_check) -------------------------
def nested_arrays(depth: int) -> dict:
    """``depth`` arrays around an integer: depth + 1 objects nested in one another."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def optional_properties(n: int) -> dict:
    """A schema xgrammar takes long to compile: ~0.3 s at n=400, ~1.5 s at 800, ~15 s at 1500 (42 KB)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def test_bounds_refuse_deep_and_large_constraints_without_walking_them():
    import time

    from paged.core.config import load_config
    from paged.core.constraint_check import check_bounds
    from paged.core.frontend.processor import structured_output_validator

    deep = [SO(json_schema=nested_arrays(depth)) for depth in (64, 400, 5000)]
    large = [SO(json_schema=optional_properties(100_000)),  # ~2.7 MB as JSON
             SO(regex="a" * 65537), SO(grammar='root ::= "' + "é" * 32767 + '"'), SO(choice=["x" * 999] * 66)]
    start = time.perf_counter()
    check_bounds(SO(json_schema=nested_arrays(63)), 64, 65536)  # 64 objects deep: the limit
    for params in deep:
        with pytest.raises(InvalidRequestError, match=r"^structured_output\.json_schema: nested deeper than 64 "
                                                      r"objects and arrays \(structured_output\.max_schema_depth\)"):
            check_bounds(params, 64, 65536)
    too_big = r"larger than 65536 bytes \(structured_output\.max_constraint_bytes\)"
    for params in large:
        with pytest.raises(InvalidRequestError, match=rf"^structured_output\.{params.kind}: {too_big}"):
            check_bounds(params, 64, 65536)
    assert time.perf_counter() - start < 0.25  # the 2.7 MB schema is walked only up to the limit
    check_bounds(SO(json_schema=optional_properties(1500)), 64, 65536)  # ~40 KB: under it
    small = structured_output_validator(load_config(overrides={"structured_output": {"max_schema_depth": 4,
                                                                                     "max_constraint_bytes": 100}}))
    with pytest.raises(InvalidRequestError, match="nested deeper than 4"):
        small(SO(json_schema=nested_arrays(4)))
    with pytest.raises(InvalidRequestError, match="larger than 100 bytes"):
        small(SO(regex="[a-z]" * 21))


def test_a_validator_without_its_backend_resolves_it_outside_an_event_loop_only(default_model_dir):
    """The API server builds its validator without the plugins (they import torch). Outside an
    event loop its first use resolves the backend and runs the backend's own check: a malformed
    regex is refused there, before any worker starts. In a loop (``AsyncLLM``) it leaves the
    plugins alone (resolving them would stall the loop for a second) and the backend's check to
    ``check_async``, which the server awaits first."""
    import asyncio
    from types import SimpleNamespace

    from paged.core.config import load_config
    from paged.core.constraint_check import ConstraintValidator

    info = SimpleNamespace(tokenizer_dir=default_model_dir, model_dir=default_model_dir, vocab_size=49152,
                           eos_token_ids=[2])
    malformed = SO(regex="(ab")
    in_loop = ConstraintValidator(load_config())

    async def add_request() -> None:
        in_loop(malformed, info)

    asyncio.run(add_request())
    assert in_loop._backend is None
    outside = ConstraintValidator(load_config())
    with pytest.raises(InvalidRequestError, match=r"^structured_output\.regex"):
        outside(malformed, info)
    assert outside.spec.name == "xgrammar" and outside._backend is not None


IGNORED_BY_XGRAMMAR = [  # (schema, the keyword its error names): xgrammar 0.2 drops each without an error
    ({"not": {}}, "not"), ({"type": "string", "not": {"const": "a"}}, "not"),
    ({"$ref": "http://127.0.0.1:1/x.json"}, "$ref"), ({"$ref": "other.json#/a"}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "contains"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"$dynamicRef": "#m"}}}, "$dynamicRef"),
]
# ... and these llguidance enforces (it intersects siblings, knows multipleOf on numbers)
IGNORED_BY_XGRAMMAR_ONLY = [
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf"),
    ({"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a", "maxLength": 1}, "maxLength"),
    ({"type": "string", "enum": ["a", 1]}, "type"),
    ({"type": "object", "properties": {"a": {"maxLength": 3}}}, "maxLength"),
]


def test_schema_keywords_xgrammar_would_ignore_are_refused_and_pydantic_schemas_are_not():
    from enum import Enum
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    from paged.core.registry import get_registry

    xgrammar, llguidance = (get_registry().structured_output_backend(b) for b in BACKENDS)
    for schema, keyword in IGNORED_BY_XGRAMMAR + IGNORED_BY_XGRAMMAR_ONLY:
        with pytest.raises(ValueError, match=r"^structured_output\.json_schema: xgrammar cannot use it: ") as info:
            xgrammar.validate(SO(json_schema=schema), None)
        assert repr(keyword) in str(info.value), (schema, str(info.value))
    for schema, _ in IGNORED_BY_XGRAMMAR:  # llguidance refuses these itself ...
        with pytest.raises(ValueError, match=r"^structured_output\.json_schema: llguidance cannot use it: "):
            llguidance.validate(SO(json_schema=schema), None)
    for schema, _ in IGNORED_BY_XGRAMMAR_ONLY:  # ... and enforces these
        llguidance.validate(SO(json_schema=schema), None)

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Inner(BaseModel):
        n: int = Field(ge=0, le=9, multiple_of=3)
        tags: list[str] = Field(max_length=3)

    class Model(BaseModel):
        name: str = Field(max_length=20, description="who")
        color: Color
        kind: Literal["a", "b"]
        inner: Optional[Inner] = None
        items: list[Inner]
        counts: dict[str, int]

    for spec in (xgrammar, llguidance):
        spec.validate(SO(json_schema=Model.model_json_schema()), None)


def test_offline_generate_refuses_what_no_output_satisfies_before_it_runs(llm):
    backend = llm.engine.config.structured_output.backend
    dead_property = {"type": "object", "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}},
                     "required": ["a"]}
    cases = [({"regex": r"[^\s\S]"}, "regex", "no output satisfies it (no token can start it)"),
             ({"grammar": "root ::= root"}, "grammar", "no output satisfies it (no token can start it)"),
             ({"json_schema": dead_property}, "json_schema",  # llguidance finds it itself
              "comes to a dead end" if backend == "xgrammar" else "required property 'a' is unsatisfiable"),
             ({"json_schema": {"not": {}}}, "json_schema", "not"), ({"json_schema": {"enum": []}}, "json_schema", ""),
             ({"json_schema": nested_arrays(400)}, "json_schema", "max_schema_depth")]
    for constraint, field, needle in cases:
        with pytest.raises(InvalidRequestError, match=rf"^structured_output\.{field}: .*{re.escape(needle)}"):
            llm.generate(["Hi", "x"], SamplingParams(max_tokens=4, structured_output=constraint), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Pick:"], SamplingParams(max_tokens=5, structured_output={"choice": ["a1", "b2"]}),
                       use_tqdm=False)
    assert out[0].outputs[0].text in ("a1", "b2")


def test_a_compile_past_the_time_limit_is_refused_and_its_worker_killed(default_model_dir):
    """xgrammar compiles 1500 optional properties in ~15 s: past a 1 s limit the worker is killed
    (a thread could not be stopped) and the verdict is remembered."""
    import time
    from types import SimpleNamespace

    from paged.core.config import load_config
    from paged.core.constraint_check import _checker_for
    from paged.core.frontend.processor import structured_output_validator

    config = load_config(overrides={"structured_output": {"constraint_check_timeout_s": 1.0}})
    info = SimpleNamespace(tokenizer_dir=default_model_dir, model_dir=default_model_dir, vocab_size=49152,
                           eos_token_ids=[2])
    validator = structured_output_validator(config)
    validator.check(SO(json_schema=SCHEMA), info)  # starts the worker
    worker = _checker_for(config, info)._idle[0]
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"^structured_output\.json_schema: not compiled within 1 s "
                                                  r"\(structured_output\.constraint_check_timeout_s\)"):
        validator.check(SO(json_schema=optional_properties(1500)), info)
    assert 1.0 <= time.monotonic() - start < 3.0
    assert worker.proc.poll() is not None  # killed
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="not compiled within"):
        validator.check(SO(json_schema=optional_properties(1500)), info)
    assert time.monotonic() - start < 0.05  # remembered
