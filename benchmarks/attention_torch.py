"""Decode attention per layer with the torch backend (compare with shared/facts.md).

    python benchmarks/attention_torch.py [--device cuda] [--batch 16] [--context 512]

B=16 decodes, 9/3 heads, head_dim 64, block 16; contexts all 512 (no padding: no mask) and
497..512 (padding: key-padding mask + zeroing of the padded rows). Times forward (KV write +
gather + SDPA) in ms: min and median of 100 runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from paged.backends.torch_attention import TorchAttentionBackend
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
                       table.to(device), torch.tensor(slots, device=device), qsl, sl)  # fmt: skip


def time_decode(dtype, seq_lens, heads=(9, 3), head_dim=64, block_size=16, device="cpu", iters=100):
    device = torch.device(device)
    layout = AttentionLayout(1, heads[0], heads[1], head_dim, block_size, dtype, device)
    backend = TorchAttentionBackend(layout)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}")
    uniform = [args.context] * args.batch
    ragged = [args.context - (i % 16) for i in range(args.batch)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for label, lens in (("uniform", uniform), ("ragged", ragged)):
            best, median = time_decode(dtype, lens, device=args.device)
            print(f"decode B={args.batch} ctx={args.context} {label:8s} {str(dtype):15s} "
                  f"min {best:6.2f}  median {median:6.2f} ms/layer")  # fmt: skip


if __name__ == "__main__":
    main()
