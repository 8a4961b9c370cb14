"""Shared pieces of the benchmarks: seeded workloads, the machine's measured limits, subprocess
phases with their own peak memory, and result printing."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"


def random_workload(num_prompts: int, seed: int, prompt_range=(32, 512), output_range=(16, 256), vocab=(1000, 20000)):
    """Prompts of random token ids (so every method sees exactly the same ids) with varied
    prompt and output lengths."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_prompts)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_prompts)
    prompts = [rng.integers(vocab[0], vocab[1], n).tolist() for n in prompt_lens]
    return prompts, output_lens.tolist()


PEAK_SHAPES = [(2048, 2048, 2048), (1024, 1024, 1024), (4096, 1024, 1024), (512, 4096, 1024)]


def measure_matmul_peak(dtype_name: str, size: int | None = None, repeats: int = 5, hf_config=None) -> float:
    """Best FLOP/s over several matmul shapes ``(M, N, K)`` with torch on this machine (all
    threads): squares, flat ones, and with ``hf_config`` the model's own projections at 512
    rows (one shape can be far from the peak on a given run: 419 vs 1991 GFLOP/s seen with
    2048^3 alone). ``size`` measures that square only."""
    import torch

    dtype = getattr(torch, dtype_name)
    shapes = [(size, size, size)] if size else list(PEAK_SHAPES)
    if hf_config is not None and not size:
        h, i = hf_config.hidden_size, hf_config.intermediate_size
        shapes += [(512, 2 * i, h), (512, h, i), (512, hf_config.vocab_size, h)]
    best = 0.0
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=dtype)
        b = torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)
        fastest = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            fastest = min(fastest, time.perf_counter() - t)
        best = max(best, 2 * m * n * k / fastest)
    return best


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Best bytes/s of a large tensor copy (bytes read + bytes written)."""
    import torch

    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_phase(script: str, args: list[str], timeout: float = 3600) -> dict:
    """Run one measurement in a fresh process (its own peak memory); it prints one JSON line last."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"phase {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def layer_flops_per_token(hf_config) -> float:
    """2 x the decoder-layer parameters each token passes through (attention over the context
    and the embedding lookup excluded)."""
    h = hf_config.hidden_size
    layers = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", heads)
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter = hf_config.intermediate_size
    per_layer = h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * inter
    return 2 * layers * per_layer


def lm_head_flops(hf_config) -> float:
    """2 x the LM head's parameters: paid once per *sampled* row, not per prompt token (the
    engine computes logits only at the rows it samples: one per generated token)."""
    return 2 * hf_config.hidden_size * hf_config.vocab_size


def model_flops(hf_config, input_tokens: int, output_tokens: int) -> float:
    """FLOPs of a run: every token through the layers, the LM head once per generated token."""
    return layer_flops_per_token(hf_config) * (input_tokens + output_tokens) + lm_head_flops(hf_config) * output_tokens


def read_bytes_per_step(model) -> float:
    """Bytes a batch-1 decode step reads: the weights as held (``model.weight_bytes()``) less
    the dense copies quantized weights keep for large batches."""
    copies = {id(m.qweight): m.qweight._dense_bytes() for m in model.modules()
              if hasattr(getattr(m, "qweight", None), "_dense_bytes")}
    return float(model.weight_bytes() - sum(copies.values()))


def weight_bytes(hf_config, itemsize: int) -> float:
    """Bytes of the weights a decode step reads: every layer and the LM head."""
    return (layer_flops_per_token(hf_config) + lm_head_flops(hf_config)) / 2 * itemsize


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def save_random_models(folder: Path, configs: dict) -> dict[str, Path]:
    """Each ``transformers`` config as a random bfloat16 model (seed 0) in ``folder/name`` with
    the default model's tokenizer files (vocabulary 49152); name -> its folder."""
    import shutil

    import torch
    import transformers

    from paged.core.loading.gguf import default_model_dir

    tokenizer_dir = default_model_dir()
    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        path = folder / name
        model.save_pretrained(path)
        for f in tokenizer_dir.iterdir():
            if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
                shutil.copy(f, path / f.name)
        out[name] = path
    return out


def alternated_rounds(llms: dict, batches: list[int], rounds: int, tokens: int, tok_s) -> dict[int, dict[str, list[float]]]:
    """batch -> name -> ``rounds`` figures of ``tok_s(llm, batch, tokens)``, the engines taking
    turns round by round (so a slow spell of the machine falls on all of them), after one short
    warm-up run each (first steps, kernel builds, caches)."""
    results: dict[int, dict[str, list[float]]] = {}
    for batch in batches:
        for llm in llms.values():
            tok_s(llm, batch, 4)
        runs: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(rounds):
            for name, llm in llms.items():
                runs[name].append(tok_s(llm, batch, tokens))
        results[batch] = runs
    return results
