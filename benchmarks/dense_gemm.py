"""Dense GEMMs on the CPU by row count: ``F.linear`` on the row-major weight against oneDNN's
packed layout (``torch.ops.mkldnn._linear_pointwise``, what ``model.cpu_prepack_weights`` gives
bfloat16 models), per dtype, one thread.

A decode step's layer weights of the default model's shapes (30 layers x qkv, o, gate_up, down;
random values), called in the model's order so that they come from memory as in a step, and the
LM head (49152 x 576) after 64 MB of other writes, so that it comes from memory too. The two
candidates alternate, one whole pass each per round; prints the median ms per pass and the ratio.

    python benchmarks/dense_gemm.py
    python benchmarks/dense_gemm.py --dtypes float32 --rows 1,2,4,8,16,64 --rounds 7

2026-12-06, the 2-core Xeon (AMX), two runs: float32 packed is 0.78-0.82x (layers) and 0.90-0.91x
(LM head) of ``F.linear`` at one row, 0.86-0.91x and 1.00x at two, then 1.40-1.56x and 1.87-2.65x
at 4-8 rows and 1.14-1.22x and 1.38-1.63x at 16-64 (layers 39 ms a pass at one row, 94-99 at
eight: MKL's float32 GEMM of a few rows against a row-major weight reads it well below the
memory's speed); bfloat16 packed 1.07-1.18x and 1.44-1.69x at every row count.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
LM_HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    flush = torch.zeros(64 * 2**20 // 4)  # written between LM-head calls: its weight leaves the caches

    def packed(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    print(f"torch {torch.__version__}, one thread; ms per pass (median of {args.rounds} rounds)")
    print(f"{'dtype':9s} {'rows':>4s} | {'layers F.linear':>15s} {'packed':>8s} {'ratio':>6s} | "
          f"{'LM head F.linear':>16s} {'packed':>8s} {'ratio':>6s}")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        dense = [[torch.randn(*shape).to(dtype) for shape in SHAPES.values()] for _ in range(args.layers)]
        packs = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in dense]
        head = torch.randn(*LM_HEAD).to(dtype)
        head_pack = torch.ops.mkldnn._reorder_linear_weight(head, None)
        for rows in args.rows:
            x_in = torch.randn(rows, 576).to(dtype)
            x_down = torch.randn(rows, 1536).to(dtype)

            def layers(weights, fn):
                for qkv, o, gate_up, down in weights:
                    fn(x_in, qkv)
                    fn(x_in, o)
                    fn(x_in, gate_up)
                    fn(x_down, down)

            def lm_head(weight, fn):
                flush.add_(1.0)
                start = time.perf_counter()
                fn(x_in, weight)
                return time.perf_counter() - start

            times: dict[str, list[float]] = {k: [] for k in ("layers", "layers_packed", "head", "head_packed")}
            for _ in range(args.rounds + 1):  # the first round warms up
                for key, weights, fn in (("layers", dense, F.linear), ("layers_packed", packs, packed)):
                    start = time.perf_counter()
                    layers(weights, fn)
                    times[key].append(time.perf_counter() - start)
                times["head"].append(lm_head(head, F.linear))
                times["head_packed"].append(lm_head(head_pack, packed))
            ms = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
            print(f"{str(dtype).removeprefix('torch.'):9s} {rows:4d} | {ms['layers']:15.1f} {ms['layers_packed']:8.1f} "
                  f"{ms['layers'] / ms['layers_packed']:5.2f}x | {ms['head']:16.2f} {ms['head_packed']:8.2f} "
                  f"{ms['head'] / ms['head_packed']:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
