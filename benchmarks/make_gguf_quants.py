"""GGUF files of the common types, made here from the default model, for benchmarks and
``benchmarks/quant_quality.py``: the embedded SmolLM2-135M-Instruct (Q4_1) written as an F16
GGUF with the ``gguf`` package (every weight dequantized, metadata copied), then quantized by
llama.cpp's ``llama-quantize`` (``../shared/tools/build-llamacpp.sh`` builds it) to each type.

SmolLM2-135M's rows are 576 inputs, not a multiple of the K-quants' 256-input super-blocks:
llama-quantize then uses its fallback for those tensors (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0),
and only the 1536-input ``ffn_down`` weights get K-quant blocks; the file lists what it holds.

    python benchmarks/make_gguf_quants.py                 # Q4_K_M Q5_K_M Q6_K Q8_0 into ~/.cache/paged-peers/gguf
    python benchmarks/make_gguf_quants.py --types Q4_K_M --out /tmp/g
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


def write_f16(source: Path, target: Path) -> None:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        if field.name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = np.asarray(dequantize(t.data.view(np.ndarray), t.tensor_type), dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, w if w.ndim == 1 else w.astype(np.float16))
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
    args = parser.parse_args(argv)

    from paged.core.loading.gguf import default_gguf_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "SmolLM2-135M-Instruct.F16.gguf"
    if not f16.is_file():
        write_f16(default_gguf_path(), f16)
    tool = Path(args.llamacpp_dir) / "llama-quantize"
    if not tool.is_file():
        raise SystemExit(f"no llama-quantize at {tool}: run ../shared/tools/build-llamacpp.sh")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{args.llamacpp_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    for qtype in args.types.split(","):
        target = out / f"SmolLM2-135M-Instruct.{qtype}.gguf"
        if not target.is_file():
            subprocess.run([str(tool), str(f16), str(target), qtype, "2"], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{target}  {target.stat().st_size / 2**20:.1f} MiB  {held_types(target)}")


if __name__ == "__main__":
    main()
