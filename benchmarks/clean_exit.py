"""How often a plain 2-rank user script dies at exit (SIGABRT, rc 134) instead of exiting 0.

The script is what a user writes: ``Trainer(accelerator="cpu", devices=2,
strategy=ZeroMoEStrategy(ep_size=2)).fit(module)`` on the tiny MoE, and nothing else (no
``destroy_process_group``). It runs ``--runs`` times, one after another, while ``--burners``
processes spin on the CPU (a busy machine is where the exit race shows). Prints each run's exit
code as it ends and then the counts.

    python benchmarks/clean_exit.py --runs 50                   # the code on PYTHONPATH
    PYTHONPATH=/path/to/old/checkout python benchmarks/clean_exit.py --runs 50   # before

``--code`` names the checkout whose ``lightning_zeromoe`` the runs import (default: this one), so
a before/after comparison is two invocations on the same machine.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = '''
import warnings
warnings.filterwarnings("ignore")
import lightning as L
from lightning_zeromoe import ZeroMoEStrategy
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

L.seed_everything(0, verbose=False)
module = TinyMoEModule(TinyMoEConfig(num_experts=4), batch_size=4, num_samples=4 * 2 * 3)
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, strategy=ZeroMoEStrategy(ep_size=2))
trainer.fit(module)
'''


def _burn(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10_000))


def _where_stuck(proc: subprocess.Popen) -> str:
    """Every process of a stuck run, children first: its native threads (gdb, when installed) and,
    through SIGABRT and faulthandler, its Python threads. Returns the run's whole stderr."""
    import shutil

    import psutil

    family = psutil.Process(proc.pid).children(recursive=True)[::-1] + [psutil.Process(proc.pid)]
    native = []
    for member in family:
        if shutil.which("gdb"):
            bt = subprocess.run(["gdb", "-p", str(member.pid), "-batch", "-ex", "thread apply all bt 12"],
                                capture_output=True, text=True, timeout=60)
            native.append(f"===== gdb, pid {member.pid}: {' '.join(member.cmdline())[:120]}\n{bt.stdout}")
    for member in family:
        try:
            member.send_signal(signal.SIGABRT)  # faulthandler prints the Python stacks, then the process dies
        except psutil.NoSuchProcess:
            pass
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err + "\n".join(native)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--burners", type=int, default=1, help="CPU-spinning processes while the runs go")
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose lightning_zeromoe is imported")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    parser.add_argument("--stuck-dir", default="clean_exit_stuck",
                        help="where the stacks of a run killed at the limit are written")
    args = parser.parse_args()

    # PYTHONFAULTHANDLER: a run killed at the limit prints every thread's Python stack (see _where_stuck).
    env = dict(os.environ, PYTHONPATH=str(args.code.resolve()), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    stuck_dir = Path(args.stuck_dir).resolve()
    burners = [multiprocessing.Process(target=_burn, args=(time.time() + 24 * 3600,), daemon=True)
               for _ in range(args.burners)]
    for proc in burners:
        proc.start()
    codes: collections.Counter[int] = collections.Counter()
    aborts = 0
    started = time.time()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "plain_fit.py"
            script.write_text(SCRIPT)
            for run in range(args.runs):
                t0 = time.time()
                proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                try:
                    _, err = proc.communicate(timeout=args.timeout)
                    rc = proc.returncode
                    tail = err.strip().splitlines()[-1:] if rc else []
                    # rank 1 (a child of the script) shares its stderr: its abort shows there too.
                    aborts += err.count("terminate called")
                except subprocess.TimeoutExpired:  # say where every process of the run was stuck
                    err = _where_stuck(proc)
                    stuck_dir.mkdir(parents=True, exist_ok=True)
                    (stuck_dir / f"run{run + 1}.stderr").write_text(err)
                    rc, tail = -999, [f"timed out; stacks in {stuck_dir / f'run{run + 1}.stderr'}"]
                codes[rc] += 1
                print(f"run {run + 1:3d}: rc {rc:4d}  {time.time() - t0:5.1f} s  {' '.join(tail)[:150]}", flush=True)
    finally:
        for proc in burners:
            proc.terminate()
    total = sum(codes.values())
    print(f"code: {args.code.resolve()}  burners: {args.burners}  runs: {total}  "
          f"wall: {time.time() - started:.0f} s")
    for rc, n in sorted(codes.items()):
        label = {0: "exit 0", 134: "SIGABRT (134)", -6: "SIGABRT (-6)", -999: "timeout"}.get(rc, f"rc {rc}")
        print(f"  {label}: {n}/{total}")
    print(f"  'terminate called' lines in the runs' stderr (either rank): {aborts}")


if __name__ == "__main__":
    main()
