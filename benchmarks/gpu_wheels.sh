#!/usr/bin/env bash
# Wheels that benchmarks/gpu_session.sh installs on a GPU machine without network (the device
# image of 2026-12: Python 3.12, torch 2.11+cu130, Triton 3.6, ninja, nvcc; none of paged's
# pydantic/msgspec/gguf/xgrammar stack). Run here, in the repository's root (.whl/ is in
# .gitignore: carried to the GPU machine with `carry`, never committed):
#
#     bash benchmarks/gpu_wheels.sh         # ~26 MB into .whl/
#
# The versions of paged's own dependencies are this venv's, so that the GPU runs what the tests
# ran here; FlashInfer 0.6.x (0.7.x is 101 MB, over the 64 MiB a call can carry). Not the
# server's stack (fastapi, uvicorn): gpu_check.py runs `paged run`, in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in pydantic pydantic_core pydantic-settings python-dotenv typing-inspection annotated-types \
            typing_extensions msgspec pyzmq gguf xgrammar; do
  pins+=("$name==$(version "$name")")
done
pins+=("flashinfer-python>=0.6,<0.7" "apache-tvm-ffi>=0.1.11,<0.2,!=0.1.8")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${pins[@]}"
du -sh "$dest"
