"""Running the multi-process jobs in tests/jobs as real subprocesses, and reading what they wrote.

Lightning starts the other ranks by re-running the launching script, so a 2-rank run cannot live
inside pytest's own process: each test launches a job script and reads its per-rank JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

JOBS = Path(__file__).resolve().parents[1] / "jobs"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test's own rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores: no oversubscription
    return env


def run(cmd: list[str], timeout: float = 300, cwd: Path | None = None,
        env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command in the jobs' environment (plus ``env_extra``); the caller checks the result."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env() | (env_extra or {}),
                          cwd=cwd or REPO)
    return proc


def fatal_stacks(root: Path = REPO) -> str:
    """The Python stacks of ranks that died of a fatal signal (SIGABRT, SIGSEGV) in a job run from ``root``:
    the strategy's flight recorder has faulthandler write them to ``<root>/flight_recorder/stacks<N>.txt``,
    which the next run overwrites. For a failed launch's message; empty when no rank left one."""
    found = []
    for path in sorted((root / "flight_recorder").glob("stacks*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            found.append(f"--- {path.name}\n{text[-3000:]}")
    return "\n".join(found)


def run_job(script: str, *args: str, timeout: float = 300, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [sys.executable]), str(JOBS / script), *args]
    proc = run(cmd, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-6000:]}\n{fatal_stacks()}")
    return proc


def read_ranks(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
