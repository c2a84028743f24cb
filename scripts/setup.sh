#!/usr/bin/env bash
# Create .venv and install lightning-zeromoe with the right torch for this machine.
#   bash scripts/setup.sh        # the package + Hugging Face extra (runs the demo)
#   bash scripts/setup.sh test   # ... + the test and docs extras
# torch comes first: a bare `pip install torch` (or deepspeed pulling it in) fetches a multi-GB CUDA
# build even on machines without a GPU. Override with TORCH_SPEC / TORCH_INDEX_URL.
# Which torch: scripts/install_torch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="hf"
[ "${1:-}" = "test" ] && extras="hf,test,docs"
PY=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip

bash scripts/install_torch.sh .venv/bin/python

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
