#!/usr/bin/env bash
# Create .venv and install lightning-zeromoe with the right torch for this machine.
#   bash scripts/setup.sh        # the package + Hugging Face extra (runs the demo)
#   bash scripts/setup.sh test   # ... + the test extra
# torch comes first: a bare `pip install torch` (or deepspeed pulling it in) fetches a multi-GB CUDA
# build even on machines without a GPU. Override with TORCH_SPEC / TORCH_INDEX_URL.
# Which torch: on a GPU machine the newest release tested with this project (2.15.0,
# lightning_zeromoe/compat.py TESTED_VERSIONS), its CUDA build from PyPI. On a CPU machine (CI
# included) 2.13.0, also tested, as a CPU build: a local wheel where pip finds one, else PyTorch's CPU
# index. PyPI's 2.15.0 is a CUDA build of several GB (it runs on CPU too): a large download for nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="hf"
[ "${1:-}" = "test" ] && extras="hf,test"
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-torch==2.15.0}
else
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip

if .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: GPU found: installing the CUDA build of $TORCH_SPEC from PyPI"
  pip install -q "$TORCH_SPEC"
elif pip install -q --no-index --no-deps "$TORCH_SPEC" 2>/dev/null \
     && .venv/bin/python -m pip install -q "$TORCH_SPEC" \
     && .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  # A local wheel (pip's find-links) that is a CPU build; its dependencies come from the index.
  echo "setup: no GPU: installed $TORCH_SPEC (CPU build) from a local wheel"
else
  echo "setup: no GPU: installing the CPU build of $TORCH_SPEC"
  pip install -q "$TORCH_SPEC" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi

pip install -q -e ".[${extras}]"
# Bytecode for this repository's own modules (pip compiles site-packages, not an editable install).
# Where PYTHONDONTWRITEBYTECODE is set, as in some sandboxes, every process would compile them
# again; the test suite starts a few hundred (tests/test_launchers.py + test_cli.py: 74 s -> 67 s).
.venv/bin/python -m compileall -q -j 0 lightning_zeromoe troubleshooter tests >/dev/null

# DeepSpeed's CPU accelerator JIT-compiles a shared-memory comm op on first use (~2 min on 2 cores,
# cached in the torch extensions dir). Build it now, once, rather than inside the first training run.
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  echo "setup: building DeepSpeed's CPU comm op (one time; cached under ~/.cache/torch_extensions)"
  DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
    2>&1 | grep -v "^\[" || true
fi
# The browser tests drive the system Chromium (Playwright cannot download its own browsers here).
if [ "${1:-}" = "test" ]; then
  if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    echo "setup: chromium already installed"
  elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (apt) for the browser tests"
    export DEBIAN_FRONTEND=noninteractive
    ok=0
    for attempt in 1 2 3; do
      if apt-get update -qq >/tmp/setup-apt.log 2>&1 \
         && apt-get install -y -qq --no-install-recommends chromium >>/tmp/setup-apt.log 2>&1; then
        ok=1; break
      fi
      echo "setup: apt attempt $attempt failed; retrying"; sleep 5
    done
    [ "$ok" = 1 ] || { tail -20 /tmp/setup-apt.log; echo "setup: could not install chromium"; exit 1; }
  else
    echo "setup: chromium missing and apt-get not usable (not root?): install chromium for tests/test_browser.py"
  fi
fi
echo "setup: done ($(.venv/bin/python -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("torch", "deepspeed", "lightning")))'))"
