"""The output processor hands each request what its RequestOutputKind asks for, from one
per-request state: DELTA increments that concatenate to the final output, FINAL_ONLY exactly
once, CUMULATIVE with the state's own lists (shared, never copied). No model: a fake engine core
and a tokenizer that spells token id k as one letter."""

from __future__ import annotations

import pytest

from paged.core.engine.model_info import ModelInfo
from paged.core.engine.outputs import EngineCoreOutput, EngineCoreRequest
from paged.core.engine.sampler import TokenLogprobs
from paged.core.frontend.outputs import RequestOutputKind
from paged.core.frontend.processor import InputProcessor, OutputProcessor
from paged.core.sampling_params import SamplingParams

DELTA, FINAL_ONLY, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE
INFO = ModelInfo("/fake", max_model_len=20000, vocab_size=26, eos_token_ids=[25], num_blocks=4096, block_size=16)


class LetterTokenizer:
    """Token id k is the letter chr(97 + k); decoding is context-free."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def _letters(text: str) -> list[int]:
    return [ord(ch) - 97 for ch in text]


def _start(kind, params=None, prompt=(1, 2, 3)):
    inputs = InputProcessor(LetterTokenizer(), INFO)
    outputs = OutputProcessor()
    state, requests = inputs.process("r", list(prompt), params or SamplingParams(max_tokens=64), output_kind=kind)
    outputs.add(state)
    return outputs, state, requests


def _steps(sample_ids: list[str], tokens: dict[str, list[int]], logprobs: bool = False):
    """One core output per live sample per step; a sample ends ("length") with its last token."""
    longest = max(len(t) for t in tokens.values())
    for k in range(longest):
        step = []
        for sid in sample_ids:
            ids = tokens[sid]
            if k < len(ids):
                lp = [TokenLogprobs(ids[k], -float(k), 1, [(ids[k], -float(k))])] if logprobs else []
                step.append(EngineCoreOutput(sid, [ids[k]], "length" if k == len(ids) - 1 else None, logprobs=lp,
                                             arrival_time=1.0, finished_time=9.0 if k == len(ids) - 1 else None))
        yield step


def _run(kind, params, tokens, logprobs=False):
    outputs, state, requests = _start(kind, params)
    handed = []
    for step in _steps([r.request_id for r in requests], tokens, logprobs):
        result = outputs.process(step)
        handed.extend(result.outputs)
    assert len(outputs) == 0  # forgotten once its last output is out
    return handed


TEXTS = {"r#0": "hello world", "r#1": "abc"}  # two samples finishing at different steps


@pytest.mark.parametrize("logprobs", [False, True])
def test_deltas_concatenate_to_the_final_output_and_final_only_comes_once(logprobs):
    params = SamplingParams(n=2, max_tokens=64, logprobs=0 if logprobs else None)
    tokens = {sid: _letters(text) for sid, text in TEXTS.items()}
    final = _run(FINAL_ONLY, params, tokens, logprobs)
    assert len(final) == 1 and final[0].finished  # exactly one output, at the end
    whole = {c.index: c for c in final[0].outputs}
    assert [whole[i].text for i in (0, 1)] == list(TEXTS.values())
    assert [whole[i].token_ids for i in (0, 1)] == list(tokens.values())
    assert all(c.new_text == c.text and c.new_token_ids == c.token_ids for c in whole.values())  # all new to it

    deltas = _run(DELTA, params, tokens, logprobs)
    assert len(deltas) == len(TEXTS["r#0"]) and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for i in (0, 1):
        pieces = [c for d in deltas for c in d.outputs if c.index == i]
        assert "".join(c.text for c in pieces) == whole[i].text
        assert [t for c in pieces for t in c.token_ids] == whole[i].token_ids
        assert all(c.text == c.new_text and c.token_ids == c.new_token_ids for c in pieces)
        assert [c.finish_reason for c in pieces].count("length") == 1 and pieces[-1].finished  # once, last
        if logprobs:
            assert [lp for c in pieces for lp in c.logprobs] == whole[i].logprobs
        else:
            assert all(c.logprobs is None for c in pieces)
    # only the samples that changed: sample 1 ("abc") is not in the later steps' outputs
    assert [len(d.outputs) for d in deltas] == [2, 2, 2] + [1] * (len(TEXTS["r#0"]) - 3)

    cumulative = _run(CUMULATIVE, params, tokens, logprobs)
    assert len(cumulative) == len(TEXTS["r#0"])
    last = {c.index: c for c in cumulative[-1].outputs}
    for i in (0, 1):
        assert (last[i].text, last[i].token_ids, last[i].logprobs) == (whole[i].text, whole[i].token_ids,
                                                                      whole[i].logprobs)
    assert "".join(o.outputs[0].new_text for o in cumulative) == whole[0].text


def test_no_output_copies_what_was_handed_out_before():
    """The per-step work does not grow with the length generated: a DELTA output holds the core's
    own new-token list, CUMULATIVE outputs share the state's growing lists, the prompt's token
    list is the one the request was built with, and FINAL_ONLY builds nothing until the end."""
    length = 3000
    tokens = [k % 26 for k in range(length)]
    params = SamplingParams(max_tokens=length, logprobs=0)

    outputs, state, (request,) = _start(DELTA, params)
    for k, step in enumerate(_steps(["r"], {"r": tokens}, logprobs=True)):
        (out,) = outputs.process(step).outputs
        (c,) = out.outputs
        assert c.token_ids is step[0].new_token_ids and c.logprobs is step[0].logprobs  # the core's, as is
        assert len(c.text) == 1 and out.prompt_token_ids is request.prompt_token_ids

    outputs, state, _ = _start(CUMULATIVE, params)
    seen_lists = set()
    for step in _steps(["r"], {"r": tokens}, logprobs=True):
        (out,) = outputs.process(step).outputs
        seen_lists.add((id(out.outputs[0].token_ids), id(out.outputs[0].logprobs)))
    assert len(seen_lists) == 1  # one list each, grown in place, never a copy per step
    assert out.outputs[0].token_ids == tokens

    outputs, state, _ = _start(FINAL_ONLY, params)
    handed = [o for step in _steps(["r"], {"r": tokens}, logprobs=True) for o in outputs.process(step).outputs]
    assert len(handed) == 1 and handed[0].outputs[0].token_ids == tokens


def test_the_n_core_requests_are_the_wire_messages_sharing_one_prompt():
    outputs, state, requests = _start(DELTA, SamplingParams(n=3, max_tokens=4, seed=5))
    assert all(isinstance(r, EngineCoreRequest) for r in requests)
    assert [r.request_id for r in requests] == ["r#0", "r#1", "r#2"] == state.sample_ids
    assert all(r.prompt_token_ids is state.prompt_token_ids for r in requests)  # built once, not per sample
    assert [r.sampling_params.seed for r in requests] == [5, 6, 7]
    assert all(r.sampling_params.stop_token_ids == [] and r.eos_token_id == 25 for r in requests)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_a_stop_string_ends_a_sample_once_and_the_core_is_told(kind):
    outputs, state, _ = _start(kind, SamplingParams(max_tokens=64, stop=["cd"]))
    handed, stopped = [], []
    for step in _steps(["r"], {"r": _letters("abcdef")}):
        result = outputs.process(step)
        handed.extend(result.outputs)
        stopped.extend(result.stopped)
    assert stopped == ["r"]  # once: the outputs after the stop are ignored
    assert handed[-1].finished and handed[-1].outputs[0].stop_reason == "cd"
    if kind is DELTA:
        assert "".join(o.outputs[0].text for o in handed) == "ab"
    else:
        assert handed[-1].outputs[0].text == "ab"
    assert len(outputs) == 0 and outputs.remove("r") == []


def test_remove_returns_only_the_samples_still_live_in_the_core():
    outputs, state, _ = _start(DELTA, SamplingParams(n=2, max_tokens=8))
    outputs.process([EngineCoreOutput("r#0", [1], "length", arrival_time=1.0)])
    assert outputs.num_live_samples == 1
    assert outputs.remove("r") == ["r#1"] and outputs.num_live_samples == 0
