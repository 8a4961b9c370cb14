"""GGUF files of the common types, made here from the default model, for benchmarks and
``benchmarks/quant_quality.py``: the embedded SmolLM2-135M-Instruct (Q4_1) written as an F16
GGUF with the ``gguf`` package (every weight dequantized, metadata copied), then quantized by
llama.cpp's ``llama-quantize`` (``../shared/tools/build-llamacpp.sh`` builds it) to each type.

SmolLM2-135M's rows are 576 inputs, not a multiple of the K-quants' 256-input super-blocks:
llama-quantize then uses its fallback for those tensors (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0),
and only the 1536-input ``ffn_down`` weights get K-quant blocks; the file lists what it holds.

    python benchmarks/make_gguf_quants.py                 # Q4_K_M Q5_K_M Q6_K Q8_0 into ~/.cache/paged-peers/gguf
    python benchmarks/make_gguf_quants.py --types Q4_K_M --out /tmp/g
    python benchmarks/make_gguf_quants.py --width 1024 --layers 16 --types Q4_K_M

``--width H`` writes instead a model whose rows are multiples of 256, as those of most models
above 1B parameters (so that a Q4_K_M file is mostly Q4_K, with Q6_K): the default model's
vocabulary, tokenizer, head size (64) and metadata, widened to hidden size H (a multiple of 256;
H / 64 heads, H / 256 KV heads, FFN 2.75 H rounded up to a multiple of 256), ``--layers`` of them, random normal weights (std
0.02; norms 1). Its text is noise; its speed is that of such a file (``benchmarks/llamacpp.py
--gguf FILE``, with ``ignore_eos``).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp import DEFAULT_DIR  # noqa: E402


def _f16_writer(reader, target: Path, changed: dict[str, object] | None = None):
    """A GGUF writer at ``target`` with ``reader``'s metadata as an F16 file's (``changed``: values
    by key without the architecture's prefix, e.g. ``embedding_length``)."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    changed = changed or {}
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        if field.name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, changed.get(field.name.removeprefix(f"{arch}."), field.contents()), kind,
                             sub_type=sub)
    return writer


def write_f16(source: Path, target: Path) -> None:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    writer = _f16_writer(reader, target)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = np.asarray(dequantize(t.data.view(np.ndarray), t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, w if w.ndim == 1 else w.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_f16_random(source: Path, target: Path, width: int, layers: int, seed: int = 0) -> None:
    """The default model's metadata and tokenizer with hidden size ``width`` and ``layers`` layers,
    random F16 weights (see the module's docstring)."""
    import gguf

    if width % 256:
        raise SystemExit(f"--width {width}: must be a multiple of 256 (the K-quants' super-block)")
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    old = {n: int(reader.fields[f"{arch}.{n}"].contents())
           for n in ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv")}
    head = old["embedding_length"] // old["attention.head_count"]
    ffn = (11 * width // 4 + 255) // 256 * 256
    new = {"embedding_length": width, "feed_forward_length": ffn, "attention.head_count": width // head,
           "attention.head_count_kv": width // 256, "block_count": layers}
    # each dimension of the source's weights, by its size, and what it becomes
    dims = {old["embedding_length"]: width, old["feed_forward_length"]: new["feed_forward_length"],
            head * old["attention.head_count_kv"]: head * new["attention.head_count_kv"]}
    writer = _f16_writer(reader, target, new)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        shape = tuple(dims.get(int(n), int(n)) for n in reversed(t.shape.tolist()))
        if len(shape) == 1:
            writer.add_tensor(t.name, np.ones(shape, dtype=np.float32))
        else:
            writer.add_tensor(t.name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def held_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    parser.add_argument("--out", default=str(Path.home() / ".cache" / "paged-peers" / "gguf"))
    parser.add_argument("--llamacpp-dir", default=os.environ.get("PAGED_LLAMACPP_DIR", str(DEFAULT_DIR)))
    parser.add_argument("--width", type=int, default=None, help="a random-weight model of this hidden size (see above)")
    parser.add_argument("--layers", type=int, default=16, help="its layers (with --width)")
    args = parser.parse_args(argv)

    from paged.core.loading.gguf import default_gguf_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "SmolLM2-135M-Instruct" if args.width is None else f"random-llama-w{args.width}-l{args.layers}"
    f16 = out / f"{stem}.F16.gguf"
    if not f16.is_file():
        if args.width is None:
            write_f16(default_gguf_path(), f16)
        else:
            write_f16_random(default_gguf_path(), f16, args.width, args.layers)
    tool = Path(args.llamacpp_dir) / "llama-quantize"
    if not tool.is_file():
        raise SystemExit(f"no llama-quantize at {tool}: run ../shared/tools/build-llamacpp.sh")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{args.llamacpp_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    for qtype in args.types.split(","):
        target = out / f"{stem}.{qtype}.gguf"
        if not target.is_file():
            subprocess.run([str(tool), str(f16), str(target), qtype, "2"], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{target}  {target.stat().st_size / 2**20:.1f} MiB  {held_types(target)}")


if __name__ == "__main__":
    main()
