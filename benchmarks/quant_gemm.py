"""paged's int4 and int8 kernels (``paged.plugins.quant_kernels``) against torch's
(``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``) on the default model's
shapes, side by side.

1. A decode step's weights: 30 layers x (qkv, o, gate_up, down), random codes, called in the
   model's order, so each weight comes from memory as in a step (66 MB, twice the L3 here);
   the two kernels alternate, one whole pass each per round. Prints ms per pass, the GB/s of
   weight bytes read (codes + bf16 scales and zeros) and the ratio torch / paged.
2. In cache: one weight of each shape over and over (the kernels' arithmetic alone).
3. The int8 LM head (``aten._weight_int8pack_mm`` against paged's ``int8_gemm``).

    python benchmarks/quant_gemm.py
    python benchmarks/quant_gemm.py --rows 1,2,4 --rounds 20
"""

from __future__ import annotations

import argparse
import time

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
LM_HEAD = (49152, 576)  # the tied embedding, Q8_0 in the GGUF: int8 per channel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)

    import numpy as np  # after the arguments: --help answers without loading torch
    import torch

    from paged.plugins import quant_kernels

    kernels = quant_kernels.load()
    if kernels is None:
        raise SystemExit("paged's int4 kernel is not available here (no AVX-512 BF16, or no compiler)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} alternated rounds")
    gen = torch.Generator().manual_seed(0)
    ours: dict[str, list] = {name: [] for name in SHAPES}
    theirs: dict[str, list] = {name: [] for name in SHAPES}
    for _ in range(args.layers):
        for name, (n, k) in SHAPES.items():
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
            scale = (torch.rand(n, k // 32, generator=gen) * 0.02).to(torch.bfloat16)
            zero = (torch.randn(n, k // 32, generator=gen) * 0.05).to(torch.bfloat16)
            ours[name].append(quant_kernels.pack(codes, scale, zero, 32))
            theirs[name].append((torch._convert_weight_to_int4pack_for_cpu(codes, 1),
                                 torch.stack([scale.t(), zero.t()], dim=-1).contiguous()))
    step_bytes = args.layers * sum(n * k // 2 + 2 * (n * k // 32) * 2 for n, k in SHAPES.values())

    def paged(x, packed):
        return kernels.int4_gemm(x, packed)

    def aten(x, weight):
        packed, sz = weight
        return torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)

    def timed(fn, xs, weights, calls_per_layer=1):
        """ms for one pass: layer by layer, each projection once (or one weight ``calls`` times)."""
        start = time.perf_counter()
        for layer in range(len(weights[next(iter(weights))])):
            for name in weights:
                fn(xs[name], weights[name][layer])
        return (time.perf_counter() - start) * 1e3

    print(f"\n1. a decode step's int4 weights ({args.layers} layers x 4 projections, "
          f"{step_bytes / 1e6:.0f} MB), ms per pass")
    print(f"{'M':>2} | {'paged ms':>8} {'GB/s':>5} | {'torch ms':>8} {'GB/s':>5} | torch/paged")
    for m in args.rows:
        xs = {name: torch.randn(m, k, generator=gen).to(torch.bfloat16) for name, (_, k) in SHAPES.items()}
        timed(paged, xs, ours), timed(aten, xs, theirs)  # warm-up
        a, b = [], []
        for _ in range(args.rounds):
            a.append(timed(paged, xs, ours))
            b.append(timed(aten, xs, theirs))
        a_ms, b_ms = float(np.median(a)), float(np.median(b))
        ratio = float(np.median(np.array(b) / np.array(a)))
        print(f"{m:>2} | {a_ms:8.2f} {step_bytes / a_ms / 1e6:5.1f} | {b_ms:8.2f} {step_bytes / b_ms / 1e6:5.1f} | {ratio:.2f}")

    print("\n2. in cache: one weight per shape, 30 calls, us per call")
    print(f"{'projection':<13} {'N x K':>11} {'M':>2} | {'paged us':>8} | {'torch us':>8} | torch/paged")
    for name, (n, k) in SHAPES.items():
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            hot_ours = {name: [ours[name][0]] * 30}
            hot_theirs = {name: [theirs[name][0]] * 30}
            a = [timed(paged, {name: x}, hot_ours) / 30 * 1e3 for _ in range(args.rounds)]
            b = [timed(aten, {name: x}, hot_theirs) / 30 * 1e3 for _ in range(args.rounds)]
            print(f"{name:<13} {n:>5}x{k:<5} {m:>2} | {np.median(a):8.1f} | {np.median(b):8.1f} | "
                  f"{np.median(np.array(b) / np.array(a)):.2f}")

    n, k = LM_HEAD
    heads = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen) for _ in range(3)]
    scale = (torch.rand(n, generator=gen) * 0.01).to(torch.bfloat16)
    head_bytes = n * k + 2 * n
    print(f"\n3. the int8 LM head ({n}x{k}, {head_bytes / 1e6:.0f} MB; three copies in turn, so each call "
          "reads from memory), ms per call")
    print(f"{'M':>2} | {'paged ms':>8} {'GB/s':>5} | {'torch ms':>8} {'GB/s':>5} | torch/paged")
    for m in args.rows:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)

        def head(fn):
            start = time.perf_counter()
            for codes in heads:
                fn(x, codes, scale)
            return (time.perf_counter() - start) * 1e3 / len(heads)

        head(kernels.int8_gemm), head(torch._weight_int8pack_mm)  # warm-up
        a, b = [], []
        for _ in range(args.rounds):
            a.append(head(kernels.int8_gemm))
            b.append(head(torch._weight_int8pack_mm))
        a_ms, b_ms = float(np.median(a)), float(np.median(b))
        print(f"{m:>2} | {a_ms:8.2f} {head_bytes / a_ms / 1e6:5.1f} | {b_ms:8.2f} {head_bytes / b_ms / 1e6:5.1f} | "
              f"{np.median(np.array(b) / np.array(a)):.2f}")


if __name__ == "__main__":
    main()
