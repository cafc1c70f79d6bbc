#!/usr/bin/env bash
# Download into .whl/ the wheels that `python -m benchmarks.gpu_check` needs on the GPU machine
# and that its image lacks (Python 3.12, x86-64, no network; it has torch, numpy, scikit-learn,
# tqdm, pytest, pytest-benchmark, hypothesis, scipy, matplotlib): optree (pmlfunc's pytree
# library), pytorch-metric-learning 2.9.0 (the peer; its own dependencies are all in the
# image) and cut-cross-entropy 25.1.1 (Apple's Cut Cross-Entropy, pure Python, for
# `python -m benchmarks.class_tiles`; its triton comes with the image's CUDA torch, hence
# --no-deps). .whl/ is git-ignored: carry it with the call (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OPTREE_VERSION="${OPTREE_VERSION:-0.20.0}"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "optree==${OPTREE_VERSION}" pytorch-metric-learning==2.9.0 cut-cross-entropy==25.1.1
ls -l .whl
