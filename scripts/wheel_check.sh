#!/usr/bin/env bash
# The wheel, tried as a user would (run by .ci/run; fails CI when any step fails):
#   1. build the wheel from a copy of the sources (the repository gets no build/ or *.egg-info);
#   2. a fresh venv outside the repository: torch first (scripts/install_torch.sh, as scripts/setup.sh),
#      then the wheel with the hf extra;
#   3. from a directory outside the repository: every console script's --help, each tool run bare
#      (help, exit 2), troubleshooter doctor, troubleshooter explain --example cuda_oom, the
#      py.typed markers, and the demo (zeromoe-demo --steps 5: 2 CPU processes, ZeRO-3 + AutoEP; it
#      JIT-builds DeepSpeed's CPU comm op once, as a user's first run does).
#   bash scripts/wheel_check.sh        # PYTHON=python3.11 to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SECONDS=0
step() { echo "wheel_check [${SECONDS}s]: $*"; }

step "building the wheel"
mkdir -p "$WORK/src"
cp -r pyproject.toml README.md lightning_zeromoe troubleshooter "$WORK/src/"
[ -f LICENSE ] && cp LICENSE "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/lightning_zeromoe-*.whl)
step "built $(basename "$WHEEL")"

step "a fresh venv in $WORK/venv: torch first, then the wheel with [hf]"
"$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
BIN=$WORK/venv/bin
"$VPY" -m pip install -q --upgrade pip
bash scripts/install_torch.sh "$VPY"
"$VPY" -m pip install -q "${WHEEL}[hf]"

mkdir "$WORK/user" && cd "$WORK/user"  # not the repository: nothing is imported from the sources
export NO_COLOR=1 PYTHONWARNINGS=ignore::FutureWarning OMP_NUM_THREADS=1
# DeepSpeed JIT-builds its CPU comm op against this venv's torch: in a folder of its own, not the shared
# ~/.cache/torch_extensions, whose build for the repository's .venv it would otherwise replace.
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions
"$VPY" - <<'PY'
import lightning_zeromoe, troubleshooter
from importlib import resources
for package in (lightning_zeromoe, troubleshooter):
    assert "site-packages" in package.__file__, package.__file__
    assert (resources.files(package) / "py.typed").is_file(), f"{package.__name__}: no py.typed"
assert "ZeroMoEStrategy" in dir(lightning_zeromoe)
print("wheel_check: imported from", lightning_zeromoe.__file__.rsplit("/", 2)[0], "; py.typed in both packages")
PY

fail() { cat help.txt; echo "wheel_check: $*"; exit 1; }
for tool in zeromoe-demo zeromoe-export zeromoe-plan troubleshooter; do
  step "$tool --help"
  "$BIN/$tool" --help > help.txt
  [[ "$(head -1 help.txt)" == "usage: $tool "* ]] || fail "$tool --help does not name $tool"
done
for tool in zeromoe-export zeromoe-plan troubleshooter; do  # the tools that need arguments, run bare
  rc=0; "$BIN/$tool" > /dev/null 2> help.txt || rc=$?
  [ "$rc" = 2 ] && grep -q "^usage: $tool " help.txt || fail "bare $tool: exit $rc, not its help and 2"
done
"$BIN/troubleshooter" doctor --help > /dev/null
"$BIN/zeromoe-plan" --mixtral-8x7b > plan.txt  # (a file, not a pipe: grep -q would close it early)
grep -q "46,702,792,704 parameters" plan.txt

step "troubleshooter doctor"
"$BIN/troubleshooter" doctor
step "troubleshooter explain --example cuda_oom"
"$BIN/troubleshooter" explain --example cuda_oom > explain.txt
head -3 explain.txt
grep -q "\[cuda-oom\]" explain.txt

step "zeromoe-demo --steps 5 (2 CPU processes)"
"$BIN/zeromoe-demo" --steps 5 --devices 2 --ep-size 2 --accelerator cpu --out "$WORK/user/demo" > demo.txt 2>&1 \
  || { tail -40 demo.txt; echo "wheel_check: the demo failed"; exit 1; }
grep -m 4 -E "tokens/s|e0:" demo.txt || true
grep -q "e0:" demo.txt || { tail -40 demo.txt; echo "wheel_check: the demo reported no expert shares"; exit 1; }
step "passed"
