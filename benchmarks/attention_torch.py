"""Decode attention per layer with the torch backend (gather + SDPA vs the fused CPU kernel).

    python benchmarks/attention_torch.py [--device cuda] [--batch 16] [--context 512]
    python benchmarks/attention_torch.py --kernel-sweep     # CPU: gather + SDPA vs the fused kernel
    python benchmarks/attention_torch.py --prefill --rounds 3  # CPU: SDPA vs the causal prefill kernel

B=16 decodes, 9/3 heads, head_dim 64, block 16; contexts all 512 (no padding: no mask) and
497..512 (padding: key-padding mask + zeroing of the padded rows). Times forward (KV write +
gather + SDPA) in ms: min and median of 100 runs.

``--prefill`` times one request's prefill (128 / 512 / 2048 new tokens, and 512 after 512 cached),
bfloat16, with SDPA and with the C++ causal kernel (option ``cpu_prefill_kernel``), 30 layers a
round, alternated.

``--kernel-sweep`` times both CPU decode paths of the backend side by side in one run (option
``cpu_decode_kernel`` off / on, the KV write included in both) at batch 1/16/64 x context
128/400/1024 (ragged: each request 0-15 tokens shorter), fp32 and bf16, over 30 layers' caches
like an engine step (see ``kernel_sweep``), and prints the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from paged.core.attention import BatchInputs


def _import_torch() -> None:
    """torch and the backend, imported once the arguments are read: ``--help`` answers at once."""
    global torch, TorchAttentionBackend, TorchAttentionOptions, AttentionLayout, BatchInputs
    import torch

    from paged.backends.torch_attention import TorchAttentionBackend, TorchAttentionOptions
    from paged.core.attention import AttentionLayout, BatchInputs


def decode_batch(seq_lens: list[int], block_size: int, num_blocks: int, device: torch.device) -> BatchInputs:
    per_req = -(-max(seq_lens) // block_size)
    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)
    table = torch.tensor([ids[i * per_req : (i + 1) * per_req] for i in range(len(seq_lens))], dtype=torch.int32)
    slots = [int(table[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(seq_lens)]
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return BatchInputs(len(seq_lens), len(seq_lens), len(seq_lens), 1, max(seq_lens), qsl.to(device), sl.to(device),
                       table.to(device), torch.tensor(slots, device=device), qsl, sl)


def time_decode(dtype, seq_lens, heads=(9, 3), head_dim=64, block_size=16, device="cpu", iters=100, kernel=False):
    device = torch.device(device)
    layout = AttentionLayout(1, heads[0], heads[1], head_dim, block_size, dtype, device)
    backend = TorchAttentionBackend(layout, TorchAttentionOptions(cpu_decode_kernel=kernel))
    num_blocks = 1 + len(seq_lens) * -(-max(seq_lens) // block_size)
    [kv] = backend.allocate_kv_cache(num_blocks)
    kv[0].normal_(), kv[1].normal_()
    meta = backend.build_metadata(decode_batch(seq_lens, block_size, num_blocks, device))
    b = len(seq_lens)
    q = torch.randn(b, heads[0], head_dim, dtype=dtype, device=device)
    k = torch.randn(b, heads[1], head_dim, dtype=dtype, device=device)
    v = torch.randn(b, heads[1], head_dim, dtype=dtype, device=device)
    times = []
    for i in range(iters + 5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.forward(q, k, v, kv, meta)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return min(times) * 1e3, statistics.median(times) * 1e3  # min: the machines here are shared


def _alternate(backends, caches, batch_inputs: BatchInputs, qkv, rounds: int) -> list[float]:
    """Each backend's best ms per layer over ``rounds`` alternated rounds (after one to warm up),
    a round being its metadata and a forward of every layer's cache in turn."""
    best = [float("inf")] * len(backends)
    for r in range(rounds + 1):
        for which, backend in enumerate(backends):
            t0 = time.perf_counter()
            meta = backend.build_metadata(batch_inputs)
            for kv in caches:
                backend.forward(*qkv, kv, meta)
            if r:
                best[which] = min(best[which], (time.perf_counter() - t0) / len(caches) * 1e3)
    return best


def kernel_sweep(layers: int, rounds: int) -> None:
    """Gather + SDPA vs the fused CPU kernel on the same caches, alternating rounds (a shared
    machine's load hits both alike). One round is a forward of every layer in turn, each layer
    with its own cache, as in an engine step: at batch 64 the caches are larger than the CPU's
    caches and come from DRAM, as they do in the engine (timing one layer over and over would
    keep them in L3)."""
    from paged.backends import cpu_paged_decode

    if cpu_paged_decode.load() is None:
        raise SystemExit("the CPU paged-decode kernel could not be built (see the warning above)")
    heads, head_dim, block_size = (9, 3), 64, 16
    print(f"{layers} layers per round, min over {rounds} rounds; ms per layer (KV write included)")
    print(f"{'dtype':9s} {'B':>3s} {'ctx':>5s}  {'gather+SDPA':>11s}  {'kernel':>7s}  {'speedup':>7s}")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 16, 64):
            for context in (128, 400, 1024):
                lens = [context - (i % 16) for i in range(batch)]  # ragged: padding in the gather path
                layout = AttentionLayout(layers, *heads, head_dim, block_size, dtype, torch.device("cpu"))
                backends = [TorchAttentionBackend(layout, TorchAttentionOptions(cpu_decode_kernel=k)) for k in (0, 1)]
                num_blocks = 1 + batch * -(-context // block_size)
                caches = backends[0].allocate_kv_cache(num_blocks)
                for kc, vc in caches:
                    kc.normal_(), vc.normal_()
                batch_inputs = decode_batch(lens, block_size, num_blocks, torch.device("cpu"))
                q = torch.randn(batch, heads[0], head_dim, dtype=dtype)
                k, v = (torch.randn(batch, heads[1], head_dim, dtype=dtype) for _ in range(2))
                best = _alternate(backends, caches, batch_inputs, (q, k, v), rounds)
                del caches
                print(f"{str(dtype)[6:]:9s} {batch:3d} {context:5d}  {best[0]:11.3f}  {best[1]:7.3f}  "
                      f"{best[0] / best[1]:6.2f}x")


def prefill_sweep(layers: int, rounds: int) -> None:
    """One request's prefill (no cached prefix, and after one), bfloat16, SmolLM2-135M's heads: the
    torch backend with SDPA against its C++ causal kernel (option ``cpu_prefill_kernel``), every
    layer in turn on its own cache, alternated rounds, ms per layer (KV write and gather included)."""
    from paged.backends import cpu_paged_decode

    if not getattr(cpu_paged_decode.kernels(), "has_prefill_causal", False):
        raise SystemExit("the causal prefill kernel is not available here (no compiler, or no AVX512-BF16)")
    heads, head_dim, block_size, dtype = (9, 3), 64, 16, torch.bfloat16
    print(f"{layers} layers per round, min over {rounds} rounds; ms per layer (KV write and gather included)")
    print(f"{'cached':>6s} {'new':>5s}  {'SDPA':>8s}  {'kernel':>8s}  {'speedup':>7s}")
    for cached, new in ((0, 128), (0, 512), (0, 2048), (512, 512)):
        total = cached + new
        layout = AttentionLayout(layers, *heads, head_dim, block_size, dtype, torch.device("cpu"))
        backends = [TorchAttentionBackend(layout, TorchAttentionOptions(cpu_prefill_kernel=k)) for k in (False, True)]
        num_blocks = 1 + -(-total // block_size)
        caches = backends[0].allocate_kv_cache(num_blocks)
        for kc, vc in caches:
            kc.normal_(), vc.normal_()
        table = list(range(1, num_blocks))
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        batch = BatchInputs(1, new, 0, new, total, torch.tensor([0, new], dtype=torch.int32),
                            torch.tensor([total], dtype=torch.int32), torch.tensor([table + [0, 0]], dtype=torch.int32),
                            torch.tensor(slots), torch.tensor([0, new], dtype=torch.int32),
                            torch.tensor([total], dtype=torch.int32))
        q = torch.randn(new, heads[0], head_dim, dtype=dtype)
        k, v = (torch.randn(new, heads[1], head_dim, dtype=dtype) for _ in range(2))
        best = _alternate(backends, caches, batch, (q, k, v), rounds)
        del caches
        print(f"{cached:6d} {new:5d}  {best[0]:8.3f}  {best[1]:8.3f}  {best[0] / best[1]:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kernel-sweep", action="store_true", help="CPU: gather + SDPA vs the fused decode kernel")
    parser.add_argument("--prefill", action="store_true", help="CPU: one prefill, SDPA vs the causal prefill kernel")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--layers", type=int, default=30, help="--kernel-sweep: layers per round (SmolLM2-135M: 30)")
    parser.add_argument("--rounds", type=int, default=5, help="--kernel-sweep: rounds per configuration")
    args = parser.parse_args()
    _import_torch()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}")
    if args.kernel_sweep:
        kernel_sweep(args.layers, args.rounds)
        return
    if args.prefill:
        prefill_sweep(args.layers, args.rounds)
        return
    uniform = [args.context] * args.batch
    ragged = [args.context - (i % 16) for i in range(args.batch)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for label, lens in (("uniform", uniform), ("ragged", ragged)):
            best, median = time_decode(dtype, lens, device=args.device, iters=args.iters)
            print(f"decode B={args.batch} ctx={args.context} {label:8s} {str(dtype):15s} "
                  f"min {best:6.2f}  median {median:6.2f} ms/layer")


if __name__ == "__main__":
    main()
