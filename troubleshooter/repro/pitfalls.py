"""``tied_weights()``, ``stale_param_copy()``, ``device_move()``: ZeRO-3 pitfalls on 2 CPU ranks.

For each pitfall the child (``_pitfalls_child``, two ranks, gloo) first trains the trap under plain
DeepSpeed and records what the user would see; then it applies what ``ZeroMoEStrategy`` applies
(``lightning_zeromoe.engine.pitfalls``: tie detection, the gradient audit, the device-move guard) and
records that. What plain DeepSpeed 0.19.8 shows is often *nothing*, and that is the finding:

* tied embedding / lm_head: training is correct (each module holding the weight gathers it);
  what fails is using the weight outside the engine's forward, where it is an empty placeholder;
* a cached ``weight.data``: no error at all, and the weight silently never trains;
* a dtype move in forward: see the numbers; the guard turns it into an error that names the call.

One launch runs all three cases (two processes importing DeepSpeed is the expensive part), and the
records are kept for the life of the process, so the three functions share it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from troubleshooter.repro._common import REPO, ChildError, child_env, html_table
from troubleshooter.repro.zero3 import free_port

CASES = ("tied_weights", "stale_param_copy", "device_move")
_RECORDS: dict[str, dict] = {}


def run_all(cases: tuple[str, ...] = CASES, *, timeout: float = 400) -> dict[str, dict]:
    """Launch the two ranks once for every case not yet recorded; return the records by case."""
    missing = [c for c in cases if c not in _RECORDS]
    if missing:
        port = free_port()
        # Each rank writes to its own files, not pipes: DeepSpeed logs a lot, and a rank blocked on a
        # full pipe that nobody reads would stall the other rank in its next collective.
        with tempfile.TemporaryDirectory(prefix="troubleshooter-pitfalls-") as tmp:
            procs, logs = [], []
            for rank in range(2):
                env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
                out = open(os.path.join(tmp, f"rank{rank}.out"), "w+")
                err = open(os.path.join(tmp, f"rank{rank}.err"), "w+")
                logs.append((out, err))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "troubleshooter.repro._pitfalls_child", json.dumps({"cases": missing})],
                    env=env, cwd=str(REPO), stdout=out, stderr=err, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout
            try:
                for proc in procs:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for proc in procs:
                    proc.kill()
                    proc.wait()
                raise ChildError(f"the pitfall reproduction did not finish in {timeout:.0f} s") from None
            texts = []
            for out, err in logs:
                out.seek(0)
                err.seek(0)
                texts.append((out.read(), err.read()))
                out.close()
                err.close()
        if any(p.returncode for p in procs):
            raise ChildError("the pitfall reproduction failed:\n" + "\n".join(e[-3000:] for _, e in texts))
        for line in texts[0][0].splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                _RECORDS[record.pop("case")] = record
    return {c: _RECORDS[c] for c in cases}


@dataclass
class PitfallResult:
    """One pitfall: what plain DeepSpeed showed (``before``) and what the handling did (``after``)."""

    name: str
    before: dict[str, Any]
    after: dict[str, Any]
    summary_line: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        lines = [f"{self.name}: {self.summary_line}", "  plain DeepSpeed:"]
        lines += [f"    {k}: {v}" for k, v in self.before.items()]
        lines += ["  with lightning_zeromoe.engine.pitfalls:"] + [f"    {k}: {v}" for k, v in self.after.items()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        keys = list(dict.fromkeys([*self.before, *self.after]))
        rows = [[k, self.before.get(k, "-"), self.after.get(k, "-")] for k in keys]
        return (f"<b>{self.name}</b>: {self.summary_line}"
                + html_table(["", "plain DeepSpeed (ZeRO-3, 2 ranks)", "with lightning_zeromoe.engine.pitfalls"], rows))


def _check(record: dict, name: str) -> dict:
    if "crashed" in record:
        raise ChildError(f"{name} reproduction crashed: {record['crashed']}\n{record.get('traceback', '')}")
    return record


def tied_weights() -> PitfallResult:
    """Tied embedding / lm_head under ZeRO-3 on 2 ranks."""
    r = _check(run_all(("tied_weights",))["tied_weights"], "tied_weights")
    before = {"training (3 steps)": f"runs, loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}",
              "tie kept after initialize": r["tie_kept"],
              "embed.weight shape outside forward": r["shape_outside"],
              "F.embedding(ids, embed.weight) outside forward": r["outside_forward"]}
    after = {"tied groups found": "; ".join(" = ".join(p) for p in r["tied"]) or "none",
             "ties broken by initialize": r["broken"] or "none",
             "embed.weight shape inside GatheredParameters": r["shape_gathered"],
             "F.embedding inside GatheredParameters": f"ok, output {r['embedding_inside_gather']}"}
    return PitfallResult("tied_weights", before, after,
                         "training with a tied weight is correct under ZeRO-3; using it outside forward fails "
                         "unless it is gathered first", r)


def stale_param_copy() -> PitfallResult:
    """A module that caches ``weight.data``: silently never trains under ZeRO-3."""
    r = _check(run_all(("stale_param_copy",))["stale_param_copy"], "stale_param_copy")
    p = r["plain"]
    before = {"error or warning": "none", "cached weight max change after 3 steps": p["cached_weight_change"],
              "other weight max change": p["other_weight_change"],
              "elements held by the cache": p["cache_numel"], "elements of this rank's partition": p["partition_numel"]}
    after = {"parameters reported as not training": ", ".join(r["stale"]) or "none",
             "attributes aliasing a gathered weight": ", ".join(r["aliases"]) or "none",
             "audit hooks left after 3 steps": r["hooks_left"],
             "first message": (r["messages"] or ["-"])[0][:160]}
    return PitfallResult("stale_param_copy", before, after,
                         "the cached copy pins the full weight and the parameter never trains; only the audit says so",
                         r)


def device_move() -> PitfallResult:
    """``.double()`` on a submodule inside forward under ZeRO-3."""
    r = _check(run_all(("device_move",))["device_move"], "device_move")
    p, h = r["plain"], r["handled"]
    before = {"outcome": p["outcome"], "param.data dtype after": p["param_data"], "partition dtype": p["partition"]}
    if "proj_weight_change" in p:
        before["proj weight max change"] = p["proj_weight_change"]
    after = {"outcome": h["outcome"]}
    return PitfallResult("device_move", before, after,
                         "DeviceMoveGuard stops the move at the call site and says what to do instead", r)
