"""paged's int4 kernel (``paged.plugins.int4_kernel``) against torch's
(``aten._weight_int4pack_mm_for_cpu``) on the default model's projection shapes, side by side.

Each kernel multiplies a bfloat16 activation of M rows by the 30 layers' worth of one projection
(30 different weights of the same random codes' shape, so nothing stays in cache between two
calls of a layer: as in a decode step), alternating the two kernels round by round; also the
same weight over and over (in cache: the kernels' arithmetic alone). Prints microseconds per
call and the GB/s of weight bytes read (codes + scales and zeros), and the ratio torch / paged.

    python benchmarks/int4_gemm.py
    python benchmarks/int4_gemm.py --rows 1,2,4 --rounds 20
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)

    from paged.plugins import int4_kernel

    gemm = int4_kernel.load()
    if gemm is None:
        raise SystemExit("paged's int4 kernel is not available here (no AVX-512 BF16, or no compiler)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} alternated rounds")
    print(f"{'projection':<13} {'N x K':>11} {'M':>2} | {'paged us':>8} {'GB/s':>5} | {'torch us':>8} {'GB/s':>5} | "
          f"{'torch/paged':>11} | in cache: paged us, torch us")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        ours, theirs = [], []
        for _ in range(args.layers):
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
            scale = (torch.rand(n, k // 32, generator=gen) * 0.02).to(torch.bfloat16)
            zero = (torch.randn(n, k // 32, generator=gen) * 0.05).to(torch.bfloat16)
            ours.append((int4_kernel.pack(codes), *int4_kernel.expand_groups(scale, zero, 32)))
            theirs.append((torch._convert_weight_to_int4pack_for_cpu(codes, 1),
                           torch.stack([scale.t(), zero.t()], dim=-1).contiguous()))
        weight_bytes = n * k // 2 + 2 * (n * k // 32) * 2
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)

            def run_ours(weights=ours):
                for packed, scales, zeros in weights:
                    gemm(x, packed, scales, zeros)

            def run_theirs(weights=theirs):
                for packed, sz in weights:
                    torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)

            def per_call(fn, calls):
                fn()
                start = time.perf_counter()
                fn()
                return (time.perf_counter() - start) / calls * 1e6

            a, b = [], []
            for _ in range(args.rounds):
                a.append(per_call(run_ours, len(ours)))
                b.append(per_call(run_theirs, len(theirs)))
            a_us, b_us = float(np.median(a)), float(np.median(b))
            ratio = float(np.median(np.array(b) / np.array(a)))
            hot_a = float(np.median([per_call(lambda: [run_ours(ours[:1]) for _ in range(30)], 30) for _ in range(5)]))
            hot_b = float(np.median([per_call(lambda: [run_theirs(theirs[:1]) for _ in range(30)], 30) for _ in range(5)]))
            print(f"{name:<13} {n:>5}x{k:<5} {m:>2} | {a_us:8.1f} {weight_bytes / a_us / 1e3:5.1f} | "
                  f"{b_us:8.1f} {weight_bytes / b_us / 1e3:5.1f} | {ratio:11.2f} | {hot_a:.1f}, {hot_b:.1f}")


if __name__ == "__main__":
    main()
