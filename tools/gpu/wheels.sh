#!/usr/bin/env bash
# Wheels a GPU machine without a package registry needs beyond its image (torch, Triton, transformers, tokenizers,
# typer, rich, ... are there; see ../.library/device/KINDS.md), for Python 3.12, into .whl/ (ignored by git).
# Versions come from constraints.txt. DeepSpeed ships only a source archive: it is built here into a pure-Python wheel
# (DS_BUILD_OPS=0: gptkit compiles no DeepSpeed op). About 16 MB in all.
# Run once, here, in the repository root: bash tools/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
pin() { grep -i "^$1==" constraints.txt | head -1 || true; }
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps "$(pin deepspeed)" -w .whl
names="hjson pydantic pydantic_core annotated-types typing-inspection fastapi starlette uvicorn opentelemetry-api ftfy
       wcwidth zstandard fastcore"
specs=""
for n in $names; do p=$(pin "$n"); specs="$specs ${p:-$n}"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $specs
ls .whl
