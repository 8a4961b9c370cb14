"""The runner's persistent batch against brute force: block tables kept incrementally over random
add / append / remove / preempt sequences equal per-request lists kept by hand, and the step
inputs the runner flattens from it (positions, slot mapping, padded block table, ...) equal a
per-token computation from those lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paged.core.engine.input_batch import InputBatch
from paged.core.engine.model_runner import ModelRunner
from paged.core.engine.request import Request
from paged.core.engine.sampler import SamplerOutput
from paged.core.engine.scheduler import ScheduledRequest, SchedulerOutput
from paged.core.utils import cdiv


def _check_against(batch: InputBatch, held: dict[str, list[int]]) -> None:
    """Every invariant of InputBatch, read from ``held`` (request id -> its block ids)."""
    assert sorted(batch.req_ids) == sorted(held) and batch.num_rows == len(held)
    assert sorted(batch.row_of.values()) == list(range(len(held)))  # no holes
    for req_id, ids in held.items():
        row = batch.row_of[req_id]
        assert batch.req_ids[row] == req_id
        assert batch.block_ids(req_id) == ids
        assert not batch.block_table[row, len(ids):].any(), "padding past a row's blocks must be 0"
    assert not batch.block_table[len(held):].any(), "free rows must be all 0"


def _padded(lists: list[list[int]]) -> np.ndarray:
    width = max([1] + [len(ids) for ids in lists])
    table = np.zeros((len(lists), width), dtype=np.int32)
    for i, ids in enumerate(lists):
        for j, b in enumerate(ids):
            table[i, j] = b
    return table


def test_condense_moves_the_last_row_into_the_hole():
    batch = InputBatch(max_num_reqs=4, max_blocks_per_req=4)
    batch.add("a", [1, 2, 3])
    batch.add("b", [4])
    batch.add("c", [5, 6])
    assert batch.remove("a")
    assert batch.req_ids == ["c", "b"] and batch.row_of == {"c": 0, "b": 1}
    assert batch.block_table[:3].tolist() == [[5, 6, 0, 0], [4, 0, 0, 0], [0, 0, 0, 0]]
    assert not batch.remove("a")  # not held any more: nothing happens
    batch.append("b", [7, 8])
    assert batch.remove("c")  # "b" moves up; its old row is cleared
    assert batch.block_table[:2].tolist() == [[4, 7, 8, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError):
        batch.add("b", [9])


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_per_request_lists(seed):
    rng = random.Random(seed)
    # Tiny capacity so rows and columns both have to grow.
    batch = InputBatch(max_num_reqs=2, max_blocks_per_req=2)
    held: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not held:
            req_id = f"r{next_id}" if rng.random() < 0.8 or not held else rng.choice(sorted(held))
            if req_id in held:  # an id re-admitted: the runner always frees it first
                batch.remove(req_id)
                del held[req_id]
            next_id += 1
            ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
            batch.add(req_id, ids)
            held[req_id] = list(ids)
        elif op < 0.75:
            req_id = rng.choice(sorted(held))
            ids = [rng.randrange(1000) for _ in range(rng.choice([0, 0, 1, 1, 3]))]
            batch.append(req_id, ids)
            held[req_id].extend(ids)
        else:
            req_id = rng.choice(sorted(held))
            assert batch.remove(req_id)
            del held[req_id]
        _check_against(batch, held)
        # The gather of a random subset of rows, in a random order, and the slots of random positions.
        subset = rng.sample(sorted(held), rng.randrange(0, len(held) + 1))
        rows = np.array([batch.row_of[r] for r in subset], dtype=np.int64)
        np.testing.assert_array_equal(batch.gather_block_table(rows), _padded([held[r] for r in subset]))
        with_blocks = [r for r in subset if held[r]]
        if with_blocks:
            bs = rng.choice([1, 4, 16])
            token_req = [rng.choice(with_blocks) for _ in range(10)]
            positions = [rng.randrange(len(held[r]) * bs) for r in token_req]
            want = [held[r][p // bs] * bs + p % bs for r, p in zip(token_req, positions)]
            got = batch.slot_mapping(np.array([batch.row_of[r] for r in token_req]), np.array(positions), bs)
            assert got.dtype == np.int64 and got.tolist() == want


# ---- the runner's flattening over random scheduler steps -----------------------------------------

BLOCK_SIZE = 4


class _SingleRank:
    size = 1


class _FirstToken:
    def forget(self, request_ids) -> None:
        pass

    def sample(self, logits, requests) -> SamplerOutput:
        return SamplerOutput([7] * len(requests), [None] * len(requests))


def _host_only_runner(captured: list) -> ModelRunner:
    """A ModelRunner with only what ``execute`` reads on the host: no model is built; the
    forward records the step's inputs."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = BLOCK_SIZE
    runner.input_batch = InputBatch(3, cdiv(64, BLOCK_SIZE))  # fewer rows than run at once: it grows
    runner.tp = _SingleRank()
    runner.sampler = _FirstToken()
    runner._forward = lambda inputs, prompt_logprobs=None: (
        captured.append(inputs) or np.zeros((len(inputs.logits_rows), 1)), None)  # (logits, hidden)
    return runner


def _expected_inputs(scheduled: list[ScheduledRequest], blocks: dict[str, list[int]]) -> dict:
    """The step's inputs token by token, from the per-request block lists kept by hand."""
    # by query length, shortest first; equal lengths in scheduled order
    order = [s for n in sorted({s.num_new_tokens for s in scheduled}) for s in scheduled if s.num_new_tokens == n]
    ids, positions, slots, qsl, seq_lens, rows = [], [], [], [0], [], []
    for i, s in enumerate(order):
        tokens = s.request.all_token_ids + list(s.spec_token_ids)  # drafts follow the last known token
        for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            ids.append(tokens[p])
            positions.append(p)
            slots.append(blocks[s.request.request_id][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + s.num_new_tokens)
        seq_lens.append(s.num_computed_tokens + s.num_new_tokens)
        if s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) == s.request.num_tokens:
            rows.extend(range(qsl[-1] - 1 - len(s.spec_token_ids), qsl[-1]))  # a row per draft, and one more
    return {
        "num_decodes": sum(1 for s in order if s.num_new_tokens == 1),
        "input_ids": ids, "positions": positions, "slot_mapping": slots, "query_start_loc": qsl,
        "seq_lens": seq_lens, "logits_rows": rows,
        "block_table": _padded([blocks[s.request.request_id] for s in order]).tolist(),
    }


@pytest.mark.parametrize("seed", range(4))
def test_runner_steps_match_a_per_token_computation(seed):
    """Requests arrive (some with a prefix-cache hit), prefill in chunks, decode (some verifying
    1-4 speculative drafts, accepted up to a random point), get preempted and re-admitted, finish
    (reported the step after, as the scheduler does) and have their ids reused; only some running
    requests are scheduled each step."""
    rng = random.Random(seed)
    captured: list = []
    runner = _host_only_runner(captured)
    running: dict[str, Request] = {}
    blocks: dict[str, list[int]] = {}  # the reference: what the KV manager would hold
    waiting: list[Request] = []
    finished_since_last: list[str] = []
    for step in range(150):
        output = SchedulerOutput(finished_request_ids=finished_since_last)
        finished_since_last = []
        for req_id in list(running):
            if rng.random() < 0.05:  # preempted by recompute: back to waiting, blocks freed
                output.preempted_request_ids.append(req_id)
                waiting.append(running.pop(req_id))
                del blocks[req_id]
        for req_id, request in list(running.items()):
            if rng.random() < 0.25:
                continue  # not scheduled this step (budget), keeps its blocks
            computed = request.num_computed_tokens
            left = request.num_tokens - computed
            n = 1 if left == 1 else rng.randint(1, min(left, 9))
            drafts = []  # a decode verifying drafts (7: what the stub sampler accepts)
            if left == 1 and rng.random() < 0.4:
                drafts = [rng.choice([7, 7, 8]) for _ in range(rng.randint(1, 4))]
                n += len(drafts)
            new = [rng.randrange(500) for _ in range(cdiv(computed + n, BLOCK_SIZE) - len(blocks[req_id]))]
            blocks[req_id].extend(new)
            output.scheduled.append(ScheduledRequest(request, computed, n, new, drafts))
            request.num_computed_tokens += n
        while rng.random() < 0.4:
            if waiting and rng.random() < 0.5:
                request = waiting.pop(0)
            else:
                reuse = output.finished_request_ids and rng.random() < 0.3
                req_id = output.finished_request_ids[0] if reuse else f"s{step}-{rng.randrange(10**6)}"
                if req_id in running or any(w.request_id == req_id for w in waiting):
                    continue
                request = Request(req_id, [rng.randrange(30000) for _ in range(rng.randint(1, 30))], max_tokens=8)
            hit = rng.choice([0, 0, BLOCK_SIZE * (rng.randrange(request.num_tokens) // BLOCK_SIZE)])
            n = rng.randint(1, request.num_tokens - hit)
            blocks[request.request_id] = [rng.randrange(500) for _ in range(cdiv(hit + n, BLOCK_SIZE))]
            output.scheduled.append(ScheduledRequest(request, hit, n, list(blocks[request.request_id])))
            request.num_computed_tokens = hit + n
            running[request.request_id] = request
        captured.clear()
        result = runner.execute(output)
        if output.scheduled:
            (inputs,) = captured
            want = _expected_inputs(output.scheduled, blocks)
            assert inputs.num_decodes == want.pop("num_decodes")
            for name, value in want.items():
                assert getattr(inputs, name).tolist() == value, f"step {step}: {name}"
            assert inputs.block_table.dtype == np.int32 and inputs.slot_mapping.dtype == np.int64
        _check_against(runner.input_batch, blocks)
        # What update_from_output would do: append the sampled tokens, finish some requests.
        for s in output.scheduled:
            request = s.request
            if s.is_sampled and s.spec_token_ids:  # the drafts up to the first that is not 7, then a 7
                accepted = next((j for j, t in enumerate(s.spec_token_ids) if t != 7), len(s.spec_token_ids))
                tokens, _ = result.spec_outputs[request.request_id]
                assert tokens == [7] * (accepted + 1)
                request.num_computed_tokens -= len(s.spec_token_ids) - accepted
                for t in tokens:
                    request.append_output_token(t)
                if request.num_output_tokens >= request.max_tokens or rng.random() < 0.1:
                    del running[request.request_id], blocks[request.request_id]
                    finished_since_last.append(request.request_id)
            elif s.is_sampled:
                assert result.sampled_token_ids[request.request_id] == 7
                request.append_output_token(7)
                if request.num_output_tokens >= request.max_tokens or rng.random() < 0.1:
                    del running[request.request_id], blocks[request.request_id]
                    finished_since_last.append(request.request_id)
    assert runner.input_batch.block_table.shape[0] > 3  # the batch grew past its first size
