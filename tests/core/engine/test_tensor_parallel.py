"""Tensor parallelism on the CPU (gloo): how heads, columns and vocabulary are split (by hand),
the step broadcast's packing, and 2 ranks against 1: the default model through `paged run`
(ranks started by the executor, and by two torchrun launchers meeting over loopback as two
machines would) and tiny random Qwen2 / Llama models through the offline API."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from paged.core.engine.distributed import HeadShard, shard_heads, shard_range
from paged.core.errors import ConfigError
from paged.core.engine.model_runner import StepInputs

PAGED = [sys.executable, "-m", "paged.core.cli"]


# ---- the partition -----------------------------------------------------------------------------


def test_shard_range_is_even_and_covers_everything():
    assert [shard_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(1536, r, 2) for r in range(2)] == [(0, 768), (768, 1536)]
    assert [shard_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_heads_follow_their_kv_group():
    # SmolLM2: 9 query heads in 3 groups of 3 over 2 ranks -> 2 groups and 1 group
    assert shard_heads(9, 3, 0, 2) == HeadShard(0, 6, 0, 2)
    assert shard_heads(9, 3, 1, 2) == HeadShard(6, 9, 2, 3)
    # fewer KV heads than ranks: each KV head replicated, its group's query heads split
    assert [shard_heads(4, 1, r, 2) for r in range(2)] == [HeadShard(0, 2, 0, 1), HeadShard(2, 4, 0, 1)]
    assert [shard_heads(8, 2, r, 4) for r in range(4)] == [
        HeadShard(0, 2, 0, 1), HeadShard(2, 4, 0, 1), HeadShard(4, 6, 1, 2), HeadShard(6, 8, 1, 2)
    ]
    with pytest.raises(ConfigError, match="tensor_parallel_size: 3 ranks cannot share 2 query heads"):
        shard_heads(2, 1, 2, 3)


def test_step_inputs_round_trip_through_one_int64_array():
    inputs = StepInputs(
        num_decodes=1,
        input_ids=np.array([5, 7, 8, 9], dtype=np.int64),
        positions=np.array([12, 0, 1, 2], dtype=np.int64),
        query_start_loc=np.array([0, 1, 4], dtype=np.int32),
        seq_lens=np.array([13, 3], dtype=np.int32),
        block_table=np.array([[4, 9], [2, 0]], dtype=np.int32),
        slot_mapping=np.array([76, 32, 33, 34], dtype=np.int64),
        logits_rows=np.array([0, 3, 1, 2], dtype=np.int64),
        num_prompt_rows=2,
    )
    packed = inputs.pack()
    assert packed.dtype == np.int64 and packed[:8].tolist() == [2, 4, 1, 2, 4, 2, 0, 0]
    back = StepInputs.unpack(packed)
    assert back.num_decodes == 1 and back.num_prompt_rows == 2
    assert back.lora_token_slots is None and back.lora_loads.shape == (0, 2)
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table", "slot_mapping", "logits_rows"):
        np.testing.assert_array_equal(getattr(back, name), getattr(inputs, name), err_msg=name)
    assert back.block_table.dtype == np.int32 and back.query_start_loc.dtype == np.int32
    # with LoRA: each token's adapter slot, and the adapters to copy into slots first
    inputs.lora_token_slots = np.array([1, -1, -1, -1], dtype=np.int32)
    inputs.lora_loads = np.array([[1, 7]], dtype=np.int64)
    packed = inputs.pack()
    assert packed[:8].tolist() == [2, 4, 1, 2, 4, 2, 1, 1]
    back = StepInputs.unpack(packed)
    np.testing.assert_array_equal(back.lora_token_slots, inputs.lora_token_slots)
    np.testing.assert_array_equal(back.lora_loads, inputs.lora_loads)
    np.testing.assert_array_equal(back.logits_rows, inputs.logits_rows)


# ---- the default model, 2 ranks vs 1 ----------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colours:",
    "Translate 'good morning' into Spanish:",
    "1, 1, 2, 3, 5, 8,",
]
# chunked prefill (8-token chunks, 24 tokens a step) so steps mix decodes and prefill chunks
# float32: TP2 must give TP1's tokens exactly (bfloat16 sums the two ranks' halves in another order).
RUN_FLAGS = ["--dtype", "float32", "--json", "--max-tokens", "16", "--ignore-eos", "--max-num-batched-tokens", "24", "--long-prefill-token-threshold", "8",
             "--logprobs", "0", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGED_")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _requests(stdout: str) -> list[dict]:
    return json.loads(stdout)["requests"]


def _assert_same_generations(got: list[dict], want: list[dict]) -> None:
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose([lp["logprob"] for lp in g["logprobs"]], [lp["logprob"] for lp in w["logprobs"]],
                                   atol=1e-4)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def tp1_generations(default_model_dir, prompts_file):
    run = subprocess.run(PAGED + ["run", "--prompts-file", str(prompts_file), *RUN_FLAGS],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    requests = _requests(run.stdout)
    assert all(len(r["token_ids"]) == 16 for r in requests)
    return requests


@pytest.mark.slow
def test_default_model_two_ranks_match_one(tp1_generations, prompts_file):
    run = subprocess.run(PAGED + ["run", "--prompts-file", str(prompts_file), "--tensor-parallel-size", "2", *RUN_FLAGS],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    _assert_same_generations(_requests(run.stdout), tp1_generations)


@pytest.mark.slow
def test_torchrun_two_launchers_over_loopback(tp1_generations, prompts_file, tmp_path):
    """What two machines would run (``--nnodes 2``, one process each, ``--node-rank`` 0 and 1,
    the same ``--master-addr``/``--master-port``), with 127.0.0.1 as the master address."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    port = str(_free_port())
    procs = []
    for node_rank in (0, 1):
        cmd = torchrun + ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
                          "--master-addr", "127.0.0.1", "--master-port", port, "-m", "paged.core.cli", "run",
                          "--prompts-file", str(prompts_file), "--tensor-parallel-size", "2", *RUN_FLAGS]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                      cwd=tmp_path))
    try:
        (out0, err0), (out1, err1) = (p.communicate(timeout=300) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, err0[-3000:]
    assert procs[1].returncode == 0, err1[-3000:]
    assert out1 == ""  # the worker rank prints nothing; rank 0 answers
    _assert_same_generations(_requests(out0), tp1_generations)


# ---- tiny random models: replicated KV heads, uneven splits, biases, 3 ranks ---------------------

TINY = {
    # 4 query heads over 1 KV head: the KV head is replicated on both ranks; q/k/v biases;
    # vocab 49155 = two shards of 24578 with one padding row
    "qwen2": lambda t: t.Qwen2Config(
        vocab_size=49155, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2),
    # every layer slides over 5 positions (prompts are longer): each rank's heads honour the window
    # and the KV manager frees the blocks behind it
    "qwen2-sliding": lambda t: t.Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.1,
        use_sliding_window=True, sliding_window=5, max_window_layers=0, bos_token_id=1, eos_token_id=2),
    # 6 query heads in 3 groups -> 2 groups and 1 group; odd MLP width (51 + 50 columns); the
    # row-parallel o_proj and down_proj biases must be added once
    "llama": lambda t: t.LlamaConfig(
        vocab_size=49152, hidden_size=96, intermediate_size=101, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=256, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2),
}


def _tiny_model(name: str, tmp_path_factory, default_model_dir) -> Path:
    import transformers

    config = TINY[name](transformers)
    config.architectures = ["Qwen2ForCausalLM" if name.startswith("qwen2") else "LlamaForCausalLM"]
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases away from 0, so a bias added twice (or never) shows
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp(f"tiny-{name}")
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(default_model_dir) / f).is_file():
            shutil.copy(Path(default_model_dir) / f, path / f)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name, tp", [("qwen2", 2), ("qwen2-sliding", 2), ("llama", 2), ("llama", 3)])
def test_tiny_models_several_ranks_match_one(name, tp, tmp_path_factory, default_model_dir):
    from paged import LLM, SamplingParams

    model_dir = _tiny_model(name, tmp_path_factory, default_model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is a city of"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=12, long_prefill_token_threshold=5)
    results = {}
    for size in (1, tp):
        with LLM(str(model_dir), tensor_parallel_size=size, **settings) as llm:
            layout = llm.engine.core.runner.layout
            outputs = llm.generate(prompts, params, use_tqdm=False)
        results[size] = ([o.outputs[0].token_ids for o in outputs],
                         [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs], layout)
    ids1, lps1, layout1 = results[1]
    ids2, lps2, layout2 = results[tp]
    assert layout2.num_heads < layout1.num_heads  # rank 0 really held a share
    assert ids2 == ids1
    np.testing.assert_allclose(lps2, lps1, atol=1e-4)
    assert len(set(t for ids in ids1 for t in ids)) > 3  # not a degenerate repeat of one token


def test_impossible_split_fails_fast_and_leaves_no_process(tmp_path_factory, default_model_dir):
    import psutil

    from paged import LLM

    model_dir = _tiny_model("qwen2", tmp_path_factory, default_model_dir)  # 4 query heads, 1 KV head
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="tensor_parallel_size: 5 ranks cannot share 4 query heads"):
        LLM(str(model_dir), device="cpu", tensor_parallel_size=5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []
