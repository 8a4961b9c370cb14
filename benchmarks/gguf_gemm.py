"""The GGUF kernels (``paged.plugins.gguf_kernels``) per block type and row count, against the
dense bfloat16 GEMM (oneDNN, prepacked: what a dense copy would run) and, for 4-bit types, the
int4 kernel (``paged.plugins.quant_kernels``), side by side.

A decode step's weights of the default model's shapes (30 layers x qkv, o, gate_up, down; random
blocks of each type), called in the model's order so that they come from memory as in a step;
the candidates alternate, one whole pass each per round. Prints ms per pass for each row count,
with the GGUF kernel's paths (K-quants on shapes widened to 768 inputs: 576 is not a multiple of
their 256-input super-blocks): ``rows``, vdpbf16ps on exact codes; ``rows-i8``, the few-rows path
with int8 activations (vpdpbusd); ``many``, dequantized bf16 panels on AMX tiles, or without AMX in
register blocks of vdpbf16ps; ``many-i8``, the panels with ``int8_panels`` (int8 codes and
activations, vpdpbusd; on AMX CPUs the same as ``many``); for every type also ``rows-x16`` and
``many-x16``, the same two paths on the interleaved layout (16 weight rows side by side; on AMX CPUs ``rows-x16`` runs 2
or more x rows on AMX tiles of the exact codes, and ``rows-x16-dp`` is it with vdpbf16ps). The row count from which
``many`` wins is what ``amx_min_rows``, or ``panel_min_rows`` without AMX, should be.

    python benchmarks/gguf_gemm.py
    python benchmarks/gguf_gemm.py --kinds q4_k,q6_k --rows 1,4,16,64,256 --rounds 7
    python benchmarks/gguf_gemm.py --by-size --kinds q4_1

``--by-size``: instead, the one-row product of the interleaved layout (a decode step's) by the
weight's size: for each of BY_SIZE's shapes, copies holding 64 MB (so each call's weight comes
from memory) called in turn; us a call and GB/s of the weight's bytes, per type of ``--kinds``.
The default model's q/k/v, o and gate/up shapes come first, its LM head's size last. 2026-12-06,
2-core EPYC, Q4_1 (two runs): 960x576 (0.35 MB) 14.7 us = 23.5 GB/s (26.5), 576x576 8.7 us =
23.8 GB/s (20.8), 3072x576 32.6 us = 33.9 GB/s (32.2), 12288x576 38.8 GB/s (36.2), 49152x576
41.6 GB/s (36.4): a short call pays a parallel region (~1.7 us; 576x576 in cache 8.2 us on one
thread, 6.1 on two) and the start of its stream.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
# K-quants need rows of whole 256-input super-blocks (576 is not): the same model widened to 768
K_SHAPES = {"qkv_proj": (1280, 768), "o_proj": (768, 768), "gate_up_proj": (4096, 768), "down_proj": (768, 2048)}
BY_SIZE = [(960, 576), (576, 576), (3072, 576), (12288, 576), (49152, 576)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="q4_0,q4_k,q5_k,q6_k,q8_0")
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--by-size", action="store_true", help="the one-row product by weight size (see above)")
    args = parser.parse_args(argv)

    import numpy as np  # after the arguments: --help answers without loading torch
    import torch

    from helpers.gguf_blocks import block_scales, gguf_dequantized, random_blocks
    from paged.plugins import gguf_kernels, quant_kernels

    kernels = gguf_kernels.load()
    if kernels is None:
        raise SystemExit("the GGUF kernels are not available here (no AVX-512 BF16, or no compiler)")
    if args.by_size:
        for kind in args.kinds.split(","):
            by_size(kernels, kind, args.rounds)
        return
    int4 = quant_kernels.load()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, AMX: {kernels.amx_available()}; "
          f"median ms per pass ({args.layers} layers x 4 projections) of {args.rounds} alternated rounds")
    for kind in args.kinds.split(","):
        weights: dict[str, list] = {"gguf": [], "x16": [], "dense": [], "int4": []}
        shapes = K_SHAPES if kind.endswith("_k") else SHAPES
        for layer in range(args.layers):
            for name, (n, k) in shapes.items():
                blocks = random_blocks(kind, n, k, seed=layer)
                w = torch.from_numpy(gguf_dequantized(blocks, kind, n, k))
                packed, fmt = gguf_kernels.pack(block_scales(blocks, kind, n, k), w)
                weights["gguf"].append((packed, fmt))
                if gguf_kernels.interleavable(n, *fmt):
                    weights["x16"].append(gguf_kernels.pack(block_scales(blocks, kind, n, k), w, interleave=True))
                weights["dense"].append(torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None))
                if int4 is not None and kind in ("q4_0", "q4_1", "q4_k"):
                    s = torch.rand(n, k // 32) * 0.02
                    weights["int4"].append(quant_kernels.pack(torch.randint(0, 16, (n, k)), s.bfloat16(), s.bfloat16(), 32))
        for extra in ("int4", "x16"):
            if not weights[extra]:
                del weights[extra]
        held = sum(p.numel() for p, _ in weights["gguf"])
        print(f"\n{kind}: shapes {list(shapes.values())}, {held / 2**20:.1f} MiB held by the GGUF layout")
        candidates = {
            "rows": lambda x, i: kernels.gemm(x, *weights["gguf"][i][:1], *weights["gguf"][i][1], 0, False, False, 1),
            "rows-i8": lambda x, i: kernels.gemm(x, *weights["gguf"][i][:1], *weights["gguf"][i][1], 0, True, False, 1),
            "many": lambda x, i: kernels.gemm(x, *weights["gguf"][i][:1], *weights["gguf"][i][1], 1, False, False, 1),
            "many-i8": lambda x, i: kernels.gemm(x, *weights["gguf"][i][:1], *weights["gguf"][i][1], 1, False, True, 1),
            "dense": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, weights["dense"][i], None, "none", [], ""),
        }
        if "x16" in weights:  # the interleaved layout (every type): few rows, and the panels read from it
            candidates["rows-x16"] = lambda x, i: kernels.gemm(x, weights["x16"][i][0], *weights["x16"][i][1], 0, False,
                                                               False, gguf_kernels.X16_ROWS)
            candidates["many-x16"] = lambda x, i: kernels.gemm(x, weights["x16"][i][0], *weights["x16"][i][1], 1, False,
                                                               False, gguf_kernels.X16_ROWS)
            if kernels.amx_available():  # rows-x16 runs 2 or more x rows on AMX tiles; this, with vdpbf16ps
                def rows_x16_dp(x, i):
                    kernels.set_amx_few_rows(False)
                    try:
                        return candidates["rows-x16"](x, i)
                    finally:
                        kernels.set_amx_few_rows(True)
                candidates["rows-x16-dp"] = rows_x16_dp
        if "int4" in weights:
            candidates["int4"] = lambda x, i: int4.int4_gemm(x, weights["int4"][i])
        print(f"{'M':>4} | " + " | ".join(f"{c:>8}" for c in candidates) + " | best")
        for m in args.rows:
            xs = {name: torch.randn(m, k).bfloat16() for name, (_, k) in shapes.items()}
            names = list(shapes)

            def one_pass(fn):
                start = time.perf_counter()
                for i in range(len(weights["gguf"])):
                    fn(xs[names[i % 4]], i)
                return (time.perf_counter() - start) * 1e3

            times: dict[str, list[float]] = {c: [] for c in candidates}
            for fn in candidates.values():
                one_pass(fn)
            for _ in range(args.rounds):
                for c, fn in candidates.items():
                    times[c].append(one_pass(fn))
            med = {c: float(np.median(t)) for c, t in times.items()}
            best = min(med, key=med.get)
            print(f"{m:>4} | " + " | ".join(f"{med[c]:8.2f}" for c in candidates) + f" | {best}")



def by_size(kernels, kind: str, rounds: int, megabytes: int = 64) -> None:
    import statistics

    import torch

    from helpers.gguf_blocks import block_scales, gguf_dequantized, random_blocks
    from paged.plugins import gguf_kernels

    print(f"\n{kind}: one x row, interleaved layout, copies holding {megabytes} MB, median of {rounds} passes")
    for n, k in BY_SIZE:
        k = 768 if kind.endswith("_k") else k  # whole 256-input super-blocks (as K_SHAPES)
        blocks = random_blocks(kind, n, k, seed=0)
        w = torch.from_numpy(gguf_dequantized(blocks, kind, n, k))
        packed, fmt = gguf_kernels.pack(block_scales(blocks, kind, n, k), w, interleave=True)
        nbytes = packed.numel() * packed.element_size()
        copies = [packed.clone() for _ in range(max(2, megabytes * 2**20 // nbytes))]
        x = torch.randn(1, k).bfloat16()

        def one_pass() -> float:
            start = time.perf_counter()
            for c in copies:
                kernels.gemm(x, c, *fmt, 0, False, False, gguf_kernels.X16_ROWS)
            return time.perf_counter() - start

        one_pass()
        seconds = statistics.median(one_pass() for _ in range(rounds))
        print(f"  {n:>5}x{k:<5} {nbytes / 1e6:7.3f} MB x {len(copies):>4} calls: {seconds / len(copies) * 1e6:7.1f} us "
              f"a call, {len(copies) * nbytes / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
