#!/usr/bin/env bash
# Install torch into a virtual environment, the build that suits this machine, before anything else:
# a bare `pip install torch` (or deepspeed pulling it in) fetches a multi-GB CUDA build even on
# machines without a GPU. Used by scripts/setup.sh (the repository's .venv) and scripts/wheel_check.sh
# (a fresh venv for the built wheel). Override with TORCH_SPEC / TORCH_INDEX_URL.
#   bash scripts/install_torch.sh VENV/bin/python
# Which torch: on a GPU machine the newest release tested with this project (2.15.0,
# lightning_zeromoe/compat.py TESTED_VERSIONS), its CUDA build from PyPI. On a CPU machine (CI
# included) 2.13.0, also tested, as a CPU build: a local wheel where pip finds one, else PyTorch's CPU
# index. PyPI's 2.15.0 is a CUDA build of several GB (it runs on CPU too): a large download for nothing.
set -euo pipefail
VPY=$1
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-torch==2.15.0}
else
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
fi
pip() { "$VPY" -m pip "$@"; }

if "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: torch $("$VPY" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: GPU found: installing the CUDA build of $TORCH_SPEC from PyPI"
  pip install -q "$TORCH_SPEC"
elif pip install -q --no-index --no-deps "$TORCH_SPEC" 2>/dev/null \
     && "$VPY" -m pip install -q "$TORCH_SPEC" \
     && "$VPY" -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  # A local wheel (pip's find-links) that is a CPU build; its dependencies come from the index.
  echo "setup: no GPU: installed $TORCH_SPEC (CPU build) from a local wheel"
else
  echo "setup: no GPU: installing the CPU build of $TORCH_SPEC"
  pip install -q "$TORCH_SPEC" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi

