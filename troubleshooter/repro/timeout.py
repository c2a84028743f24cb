"""A collective timeout that does not hold: DeepSpeed's expert groups ignore the world timeout.

Two gloo ranks. The world group gets a short timeout (what ``Trainer``/``init_distributed`` set).
A sub-group is then created the way ``deepspeed/utils/groups.py`` creates the expert-parallel and
expert-data-parallel groups, ``new_group(ranks)``, which takes the backend default (gloo: 30 min,
NCCL: 10 min) instead. Rank 1 stays away; rank 0 waits in an all-reduce on the sub-group.

* without the fix, rank 0 is still waiting long after the world timeout, until rank 1 goes away;
* with ``lightning_zeromoe.strategy.apply_timeout_to_all_groups`` (what ``ZeroMoEStrategy`` runs
  after ``deepspeed.initialize``), rank 0 fails after the world timeout with gloo's own
  "Timed out" error.
"""

from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from troubleshooter.repro._common import REPO, child_env, html_table

CHILD = Path(__file__).with_name("_timeout_child.py")


@dataclass(frozen=True)
class TimeoutRun:
    """Rank 0's view of one run."""

    fixed: bool
    world_timeout: float
    expert_group_timeout: float
    waited: float
    error: str | None

    @property
    def timed_out(self) -> bool:
        return self.error is not None and "timed out" in self.error.lower()


@dataclass(frozen=True)
class TimeoutResult:
    before: TimeoutRun
    after: TimeoutRun
    stuck_for: float

    def _repr_html_(self) -> str:
        rows = [[("with" if r.fixed else "without") + " the fix", f"{r.world_timeout:g} s",
                 f"{r.expert_group_timeout:g} s", f"{r.waited:.1f} s", r.error or "none"]
                for r in (self.before, self.after)]
        return html_table(["run", "world timeout", "expert-group timeout", "rank 0 waited", "error"], rows)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(timeout_s: float, stuck_for_s: float, fix: bool) -> TimeoutRun:
    port = _free_port()
    common = ["--port", str(port), "--timeout", str(timeout_s), "--stuck-for", str(stuck_for_s)]
    common += ["--fix"] if fix else []
    procs = [subprocess.Popen([sys.executable, str(CHILD), "--rank", str(rank), *common], cwd=str(REPO),
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL) for rank in (0, 1)]
    limit = 120 + stuck_for_s
    try:
        outputs = [proc.communicate(timeout=limit) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    lines = [line for line in outputs[0][0].splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the timeout reproduction's rank 0 printed no result:\n{outputs[0][1][-3000:]}")
    record = json.loads(lines[-1])
    return TimeoutRun(fixed=fix, world_timeout=record["world_timeout"],
                      expert_group_timeout=record["expert_group_timeout"], waited=record["waited"],
                      error=record["error"])


@functools.lru_cache(maxsize=4)
def collective_timeout(timeout_s: float = 4.0, stuck_for_s: float = 15.0) -> TimeoutResult:
    """Run the two-rank reproduction without and with the fix (about 30 s on 2 CPU cores).

    The result is kept for the process, like the other reproductions' results.
    """
    if not 0 < timeout_s < stuck_for_s:
        raise ValueError(f"need 0 < timeout_s ({timeout_s}) < stuck_for_s ({stuck_for_s}) to tell them apart")
    return TimeoutResult(before=_run(timeout_s, stuck_for_s, fix=False), after=_run(timeout_s, stuck_for_s, fix=True),
                         stuck_for=stuck_for_s)
