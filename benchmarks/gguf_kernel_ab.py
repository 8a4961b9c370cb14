"""Two sources of the GGUF kernels (``plugins/gguf_kernels.cpp``) side by side: each call timed
with its weight in cache on one thread, and whether the two give the same bits.

What a kernel change needs before it lands, on machines where a whole decode step moves 5-10%
from one run to the next (the 30-layer passes of ``gguf_gemm.py`` stream their weights from memory,
and that memory is shared): the change's own cost, per type, shape and row count, with nothing
else in the measurement. Each source is built under its own name (``paged.core.native``: a build
per source hash, kept), then the two run in separate processes, alternated, ``--rounds`` times;
each process times ``--calls`` calls per case and keeps its fastest, and the table shows the
median over rounds. The outputs of every case are compared by hash: "same" means bit for bit.

    git show HEAD:plugins/gguf_kernels.cpp > /tmp/old.cpp
    python benchmarks/gguf_kernel_ab.py /tmp/old.cpp plugins/gguf_kernels.cpp
    python benchmarks/gguf_kernel_ab.py /tmp/old.cpp plugins/gguf_kernels.cpp --kinds q4_k --shapes 3072x768 --rows 16,64 --path many

Measured on 2026-12-05 (2-core Xeon with AMX, a day on which the 30-layer passes varied by 10%):
the many-rows panels of 4-bit codes transposed as stored (ca9c5b8) against the source before it,
``--kinds q4_1,q8_0,q4_k --shapes 2048x576,1536x768 --rows 1,16``: at 16 rows (the panels) B / A
0.94 and 0.91 (Q4_1), 0.93 (Q4_K); Q8_0, whose code did not change, 0.94 and 1.03, and every
1-row case (the unchanged few-rows kernel) 0.97-1.01: the noise is about 5%. Every output the same.
(Those ran the row layout, ``--layout rows``; the weights are interleaved, ``--layout x16``, by
default since.) On 2026-12-06 (2-core EPYC, no AMX), the interleaved few-rows kernel decoding a unit
for all of a call's tiles before each broadcast of x feeds them (2aeba02) against its parent,
``--kinds q4_1,q5_0,q4_k,q6_k,q8_0 --shapes 2048x576,1536x1536 --rows 1,2,3,4,5,8 --path rows``:
B / A 0.82-0.87 at 4 and 5 rows for the 4-, 5- and 6-bit types (Q6_K 0.86-0.90, Q8_0 0.88-0.90),
0.90-0.97 at one row, 0.94-1.05 at 2 and 3 rows, 0.98-1.00 at 8 (one tile at a time, as before).
Every output the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _cases(args) -> list[tuple[str, int, int, int]]:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    return [(kind, n, k, m) for kind in args.kinds.split(",") for n, k in shapes for m in args.rows]


def worker(args) -> None:
    """In a process of its own: load ``args.source``'s build, time every case, print one JSON line."""
    import torch

    from helpers.gguf_blocks import block_scales, gguf_dequantized, random_blocks
    from paged.core import native
    from paged.core.loading import gguf_blocks
    from paged.plugins import gguf_kernels

    gguf_kernels._SOURCE = native.read_source(Path(args.source))  # build_name() and load() read it
    kernels = gguf_kernels.load()
    if kernels is None:
        raise SystemExit(f"{args.source}: the kernels did not build or cannot run here")
    if args.build_only:
        return
    torch.set_num_threads(args.threads)
    many_min_rows = 1 if args.path == "many" else 0
    result, weights = {}, {}
    for kind, n, k, m in _cases(args):
        if k % gguf_blocks.TYPES[kind].super_block:
            continue  # K-quants need whole 256-input super-blocks
        if (kind, n, k) not in weights:
            blocks = random_blocks(kind, n, k, seed=1)
            exact = torch.from_numpy(gguf_dequantized(blocks, kind, n, k))
            weights[(kind, n, k)] = gguf_kernels.pack(block_scales(blocks, kind, n, k), exact,
                                                      interleave=args.layout == "x16")
        packed, fmt = weights[(kind, n, k)]
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()

        # sources from before the interleaved layout take no interleave argument (the row layout)
        layout = (gguf_kernels.X16_ROWS if args.layout == "x16" else 1,) if "interleave" in (kernels.gemm.__doc__ or "") else ()

        def call():
            return kernels.gemm(x, packed, *fmt, many_min_rows, False, False, *layout)

        for _ in range(10):
            out = call()
        fastest = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            fastest = min(fastest, (time.perf_counter() - start) / args.calls)
        digest = hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
        result[f"{kind} {n}x{k} M={m}"] = [fastest * 1e6, digest]
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs=2, metavar="SOURCE", help="A and B: two versions of gguf_kernels.cpp")
    parser.add_argument("--kinds", default="q4_0,q4_1,q4_k,q6_k,q8_0")
    parser.add_argument("--shapes", default="2048x576,1536x768,1536x1536", help="N x K per case (weights in L2)")
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--path", choices=["auto", "rows", "many"], default="auto",
                        help="rows: the few-rows kernel at every row count; many: the panels (AMX or AVX-512) at "
                             "every row count; auto: rows below 6 rows, the panels from 6 (the defaults on AMX)")
    parser.add_argument("--layout", choices=["x16", "rows"], default="x16",
                        help="the weights' layout: x16 interleaved (the default's), or rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=50, help="calls per timing (the fastest of 5 timings is kept)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    def run(source: str, *extra: str) -> str:
        cmd = [sys.executable, __file__, *args.sources, "--worker", "--source", source, "--kinds", args.kinds,
               "--shapes", args.shapes, "--rows", ",".join(map(str, args.rows)), "--path", args.path,
               "--layout", args.layout,
               "--threads", str(args.threads), "--calls", str(args.calls), *extra]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    if args.path == "auto":  # split: the rows path below 6 rows, the panels from 6, as the defaults on AMX
        few = [m for m in args.rows if m < 6]
        many = [m for m in args.rows if m >= 6]
        for path, rows in (("rows", few), ("many", many)):
            if rows:
                main([*args.sources, "--kinds", args.kinds, "--shapes", args.shapes, "--rows", ",".join(map(str, rows)),
                      "--path", path, "--layout", args.layout, "--threads", str(args.threads), "--calls", str(args.calls),
                      "--rounds", str(args.rounds)])
        return
    for source in args.sources:  # build each once, before any timing
        run(source, "--build-only")
    times: dict[str, list[list[float]]] = {}
    digests: dict[str, list[set[str]]] = {}
    for _ in range(args.rounds):
        for i, source in enumerate(args.sources):
            for case, (us, digest) in json.loads(run(source).strip().splitlines()[-1]).items():
                times.setdefault(case, [[], []])[i].append(us)
                digests.setdefault(case, [set(), set()])[i].add(digest)
    a, b = (Path(s).name for s in args.sources)
    print(f"{args.path} path, {args.layout} layout, {args.threads} thread(s), weights in cache; us per call, median of {args.rounds} "
          f"alternated rounds (each the fastest of 5 x {args.calls} calls)")
    print(f"{'case':26s} | {'A ' + a:>14s} | {'B ' + b:>14s} | B / A | bits")
    for case, (ta, tb) in times.items():
        ma, mb = statistics.median(ta), statistics.median(tb)
        da, db = digests[case]
        bits = "same" if da == db and len(da) == 1 else "differ"
        print(f"{case:26s} | {ma:14.1f} | {mb:14.1f} | {mb / ma:5.2f} | {bits}")


if __name__ == "__main__":
    main()
