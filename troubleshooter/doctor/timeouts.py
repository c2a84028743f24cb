"""Collective timeouts: the variables people set, what reads them, and the sub-group trap.

Facts, checked against torch 2.13, deepspeed 0.19.8 and lightning 2.6.6:

* ``NCCL_TIMEOUT`` is read by nothing (not torch, NCCL, deepspeed or lightning).
* ``DEEPSPEED_TIMEOUT`` (minutes, default 10) sets deepspeed's ``default_pg_timeout``
  (deepspeed/constants.py does ``int(os.getenv("DEEPSPEED_TIMEOUT", 10))`` at import, so a
  non-integer makes ``import deepspeed`` fail). Lightning passes its own timeout to
  ``deepspeed.init_distributed``, which wins for the world group.
* ``new_group(ranks)`` without ``timeout=`` gets the backend default
  (distributed_c10d.py: ``timeout = _get_default_timeout(backend)``: 30 min for gloo, 10 min for
  NCCL), not the world group's timeout, and deepspeed/utils/groups.py creates every expert group
  that way. The torch probe re-measures this on the installed torch each run.
* ``TORCH_NCCL_*`` knobs: the table below; each set knob is also looked up in the installed torch's
  shared libraries, so a misspelt or unsupported one is caught.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_zeromoe import compat
from troubleshooter.doctor.base import CheckResult, DoctorOptions, error_result
from troubleshooter.doctor.probes import ProbeSet
from troubleshooter.doctor.versions import package_dir


#: name -> (meaning, a risky value or None). Names checked against the installed torch 2.13 (CPU
#: build: the strings of libtorch_cpu.so) and, for the CUDA-only ones, PyTorch's
#: docs/source/torch_nccl_environment_variables.md.
TORCH_NCCL_KNOBS: dict[str, tuple[str, str | None]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "what the watchdog does on a failed or timed-out collective: 3 (default) tears the process "
        "down, 1 aborts the communicator and tears down, 2 aborts only, 0 does nothing", "0"),
    "TORCH_NCCL_BLOCKING_WAIT": (
        "1 makes work.wait() block and raise when the collective times out (debugging aid)", None),
    "TORCH_NCCL_ENABLE_MONITORING": (
        "1 starts a monitor that kills the process when the watchdog itself is stuck for "
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "0"),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": (
        "how long the monitor waits for a watchdog heartbeat before aborting", None),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (
        "1 dumps the flight recorder on a watchdog timeout (needs TORCH_NCCL_TRACE_BUFFER_SIZE > 0)",
        None),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": (
        "events kept by the flight recorder; 0 disables it and the timeout dumps", None),
    "TORCH_NCCL_TRACE_CPP_STACK": ("1 records C++ stacks in the flight recorder", None),
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": ("file prefix the flight-recorder dump is written to", None),
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": ("a pipe; writing to it triggers a dump", None),
    "TORCH_NCCL_DESYNC_DEBUG": ("1 reports which rank is out of step when a collective times out",
                                None),
    "TORCH_NCCL_ENABLE_TIMING": ("1 records start events to time every collective", None),
    "TORCH_NCCL_HIGH_PRIORITY": ("1 runs NCCL on high-priority CUDA streams", None),
    "TORCH_NCCL_NAN_CHECK": ("1 checks collective inputs for NaN and raises", None),
    "TORCH_NCCL_COORD_CHECK_MILSEC": ("monitor's polling interval for dump signals (ms)", None),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": ("extra time to finish a dump before exiting (ms)", None),
}
#: Old names torch still reads (found next to the new ones in libtorch_cpu.so) but warns about.
LEGACY_NAMES = {"NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT"}


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """NCCL_TIMEOUT, DEEPSPEED_TIMEOUT, TORCH_NCCL_* knobs, and sub-group inheritance."""
    env = options.env
    return [nccl_timeout_result(env), deepspeed_timeout_result(env), knobs_result(env),
            subgroup_result(options, probes)]


def nccl_timeout_result(env: Mapping[str, str]) -> CheckResult:
    """NCCL_TIMEOUT does nothing; say what does."""
    title = "NCCL_TIMEOUT"
    if "NCCL_TIMEOUT" not in env:
        return CheckResult("timeouts.nccl_timeout", title, "ok", "not set")
    return CheckResult(
        "timeouts.nccl_timeout", title, "warn", f"NCCL_TIMEOUT={env['NCCL_TIMEOUT']} is set",
        why=compat.ENV_FACTS["NCCL_TIMEOUT"],
        fix="Unset it; pass ZeroMoEStrategy(timeout=timedelta(minutes=...)) (or Lightning's "
            "strategy timeout), or set DEEPSPEED_TIMEOUT=<minutes> for plain deepspeed.",
        entry="nccl-timeout-env-ignored", details={"value": env["NCCL_TIMEOUT"]})


def deepspeed_timeout_result(env: Mapping[str, str]) -> CheckResult:
    """DEEPSPEED_TIMEOUT must be an integer number of minutes."""
    title = "DEEPSPEED_TIMEOUT"
    value = env.get("DEEPSPEED_TIMEOUT")
    if value is None:
        return CheckResult("timeouts.deepspeed_timeout", title, "ok",
                           "not set (deepspeed's default: 10 min; Lightning passes its own, 30 min)",
                           why=compat.ENV_FACTS["DEEPSPEED_TIMEOUT"])
    try:
        minutes = int(value)
    except ValueError:
        return CheckResult(
            "timeouts.deepspeed_timeout", title, "fail", f"DEEPSPEED_TIMEOUT={value!r}",
            why="deepspeed/constants.py calls int() on it at import: `import deepspeed` raises "
                "ValueError.", fix="Set a whole number of minutes, e.g. DEEPSPEED_TIMEOUT=60.",
            details={"value": value})
    return CheckResult("timeouts.deepspeed_timeout", title, "ok", f"{minutes} min",
                       why=compat.ENV_FACTS["DEEPSPEED_TIMEOUT"], details={"value": value})


def torch_reads(names: list[str]) -> dict[str, bool] | None:
    """Whether each name occurs in the installed torch's shared libraries (None: no torch)."""
    root = package_dir("torch")
    if root is None or not names:
        return None
    found = dict.fromkeys(names, False)
    for lib in sorted((root / "lib").glob("libtorch*.so*")):
        _scan_binary(lib, found)
    return found


def _scan_binary(path: Path, found: dict[str, bool]) -> None:
    """Mark the names that appear NUL-terminated in ``path`` (a C string constant)."""
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for name in found:
                if not found[name] and data.find(name.encode() + b"\0") != -1:
                    found[name] = True
    except (OSError, ValueError):
        return


def knobs_result(env: Mapping[str, str]) -> CheckResult:
    """Explain every TORCH_NCCL_* (and legacy NCCL_*) knob that is set; flag risky or unknown ones."""
    title = "TORCH_NCCL_* knobs"
    names = sorted(k for k in env if k.startswith("TORCH_NCCL_") or k in LEGACY_NAMES)
    if not names:
        return CheckResult("timeouts.torch_nccl", title, "ok", "none set: torch's defaults apply",
                           why="by default the watchdog tears the process down on a collective "
                               "timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=3).",
                           entry="nccl-watchdog-timeout")
    reads = torch_reads(names) or {}
    lines, problems = [], []
    for name in names:
        value = env[name]
        if name in LEGACY_NAMES:
            problems.append(f"{name} is the deprecated name of {LEGACY_NAMES[name]}")
            continue
        meaning, risky = TORCH_NCCL_KNOBS.get(name, (None, None))
        if meaning is None:
            problems.append(f"{name} is not a knob the doctor knows"
                            + ("" if reads.get(name) else " and not in this torch's libraries"))
            continue
        lines.append(f"{name}={value}: {meaning}"
                     + ("" if reads.get(name) else " (not in this torch build's libraries)"))
        if risky is not None and value.strip() == risky:
            problems.append(f"{name}={value} leaves hung or failed collectives running")
    details: dict[str, Any] = {"set": {n: env[n] for n in names}, "in_torch_libraries": reads}
    found = "; ".join(problems + lines)
    if problems:
        return CheckResult("timeouts.torch_nccl", title, "warn", found,
                           why="a collective that times out should end the job with a dump, not "
                               "hang it.",
                           fix="Unset the flagged variables (or use their TORCH_NCCL_ names).",
                           entry="nccl-watchdog-timeout", details=details)
    return CheckResult("timeouts.torch_nccl", title, "ok", found, entry="nccl-watchdog-timeout",
                       details=details)


def subgroup_result(options: DoctorOptions, probes: ProbeSet) -> CheckResult:
    """Measured: does a group from new_group(ranks) inherit the world group's timeout?"""
    title = "Expert sub-group timeout"
    stage, outcome = probes.stage("subgroup")
    if stage is None or "exception" in stage:
        reason = stage["exception"] if stage else outcome.describe_failure(options.timeout)
        return error_result("timeouts.subgroup", title, f"gloo sub-group probe: {reason}",
                            why="the probe creates a 1-rank gloo world and a new_group to measure "
                                "the timeouts.", details={"stderr_tail": outcome.stderr[-2000:]})
    world, sub = stage["world_timeout_s"], stage["subgroup_timeout_s"]
    nccl = stage.get("nccl_default_s")
    found = (f"world group created with timeout {world / 60:g} min; new_group(ranks) got "
             f"{sub / 60:g} min (gloo default {stage['backend_default_s'] / 60:g} min"
             + (f", NCCL default {nccl / 60:g} min)" if nccl else ")"))
    if sub == world:
        return CheckResult("timeouts.subgroup", title, "ok", found + ": sub-groups inherit it",
                           entry="subgroup-timeout", details=stage)
    return CheckResult(
        "timeouts.subgroup", title, "warn", found + ": sub-groups do not inherit it",
        why="deepspeed/utils/groups.py creates the expert-parallel and expert-data-parallel groups "
            "with new_group(ranks), so raising the world timeout does not protect the expert "
            "all-to-all: on NCCL it still times out at the backend default.",
        fix="Use ZeroMoEStrategy(timeout=...): after deepspeed.initialize it sets the timeout on "
            "every group (lightning_zeromoe/strategy.py apply_timeout_to_all_groups). With plain "
            "deepspeed, call lightning_zeromoe._torch_private.set_group_timeout(timeout, group) (which "
            "wraps torch's private distributed_c10d._set_pg_timeout, present in 2.13) for each expert group.",
        entry="subgroup-timeout", details=stage)
