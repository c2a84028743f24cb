"""The result type every doctor check returns, and the time-limited subprocess probe.

Why a probe runs in a subprocess: importing torch or deepspeed costs seconds, and touching CUDA,
NCCL or a hung network file system can block forever. A subprocess can be killed; an import in
this process cannot. Every probe therefore has a hard wall-clock limit, and a probe that dies or
hangs becomes a result with status ``error`` instead of a doctor that hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from troubleshooter import knowledge
from troubleshooter.knowledge import Fix

#: Allowed values of :attr:`CheckResult.status`, from best to worst for display purposes.
STATUSES = ("ok", "skip", "warn", "fail", "error")


@dataclass(frozen=True)
class CheckResult:
    """One finding of the doctor.

    ``status`` is ok | warn | fail | skip | error; ``error`` means the probe itself died or timed
    out, so the doctor could not tell. ``found`` says what was seen (filled with the value, the
    key, the path), ``why`` why it matters and ``fix`` what to do: both are knowledge-base texts
    (see :func:`cite`), ``fix_id`` names the fix as ``entry/fix``, and ``entry`` names the
    knowledge-base entry with the long explanation.
    """

    id: str
    title: str
    status: str
    found: str
    why: str = ""
    fix: str = ""
    entry: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    fix_id: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r} for check {self.id}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (details are kept JSON-serialisable by the checks)."""
        return asdict(self)


@dataclass(frozen=True)
class ProbeOutcome:
    """What a subprocess probe produced: its exit code and output, or why it gave none."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    launch_error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the process started, finished in time and exited 0."""
        return self.launch_error is None and not self.timed_out and self.returncode == 0

    def describe_failure(self, limit_s: float | None = None) -> str:
        """One line that says how the probe died, for a result's ``found``."""
        cmd = os.path.basename(self.argv[0]) if self.argv else "probe"
        if self.launch_error is not None:
            return f"could not run {cmd}: {self.launch_error}"
        if self.timed_out:
            limit = f" limit of {limit_s:g} s" if limit_s is not None else " time limit"
            return f"{cmd} did not finish within its{limit}; it was killed"
        tail = last_line(self.stderr) or last_line(self.stdout) or "no output"
        return f"{cmd} exited with status {self.returncode}: {tail}"


def exit_code(results: Sequence[CheckResult]) -> int:
    """1 when a check failed or could not be checked (``error``), else 0."""
    return 1 if any(r.status in ("fail", "error") for r in results) else 0


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, trimmed to a readable length."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_probe(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
              cwd: str | None = None,
              on_start: Callable[[subprocess.Popen], None] | None = None) -> ProbeOutcome:
    """Run ``argv`` with a hard time limit; never raise, never hang.

    The child gets its own session (process group), so on timeout the whole group is killed:
    a probe that spawned helpers (a compiler, ninja, nvcc's own children) leaves nothing behind.
    Output produced before the kill is kept, so a probe that reports in stages still says how far
    it got. ``on_start`` receives the process, so an owner can kill it early (on Ctrl-C).
    """
    start = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace",
                                env=dict(env) if env is not None else None, cwd=cwd,
                                start_new_session=True)
    except OSError as err:
        return ProbeOutcome(tuple(argv), None, "", "", time.monotonic() - start,
                            launch_error=str(err))
    if on_start is not None:
        on_start(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
        return ProbeOutcome(tuple(argv), proc.returncode, out, err, time.monotonic() - start)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = _drain(proc)
        return ProbeOutcome(tuple(argv), proc.returncode, out, err, time.monotonic() - start,
                            timed_out=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the probe's whole process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _drain(proc: subprocess.Popen) -> tuple[str, str]:
    """Collect what the killed probe had written; bounded, in case a grandchild keeps a pipe."""
    try:
        out, err = proc.communicate(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = "", ""
    return out or "", err or ""


def run_python_probe(code: str, args: Sequence[str], timeout: float,
                     env: Mapping[str, str] | None = None,
                     on_start: Callable[[subprocess.Popen], None] | None = None) -> ProbeOutcome:
    """Run ``code`` in a fresh interpreter (this one's executable) under the same time limit."""
    return run_probe([sys.executable, "-c", code, *args], timeout, env=env, on_start=on_start)


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` that is a JSON object; other output (warnings, logs) is skipped."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


def cite(fix: Fix, **values: Any) -> dict[str, str]:
    """The ``fix`` and ``fix_id`` keywords of a result for a knowledge-base fix, filled in."""
    return {"fix": fix.render(**values), "fix_id": f"{fix.entry}/{fix.id}"}


def error_result(check_id: str, title: str, found: str, *, why: str = "", timeout: float = 60.0,
                 entry: str | None = None, details: dict[str, Any] | None = None) -> CheckResult:
    """A result for a probe that died: the doctor could not tell, and says so."""
    return CheckResult(check_id, title, "error", found, why=why,
                       **cite(knowledge.fix("doctor-run", "larger-timeout"), timeout=timeout),
                       entry=entry or "doctor-run", details=details or {})


def process_ids() -> list[str]:
    """The ids of the processes in ``/proc`` (none where there is no /proc), for reading their files."""
    return [d for d in os.listdir("/proc") if d.isdigit()] if os.path.isdir("/proc") else []


#: The check families, in the order they run and are shown.
FAMILIES = ("versions", "cuda", "build", "env", "timeouts", "nccl", "host", "layout", "config")


@dataclass(frozen=True)
class DoctorOptions:
    """Everything a doctor run depends on, so checks can run in-process with a chosen setting.

    ``env`` is the environment the checks read and the probes run under (default: this process's),
    ``shm_path`` is where shared memory is measured (a small tmpfs or a directory in tests).
    """

    config: str | None = None
    ep_size: int | None = None
    num_experts: int | None = None
    gpus_per_node: int | None = None
    world_size: int | None = None
    timeout: float = 60.0
    shm_path: str = "/dev/shm"
    stale_lock_minutes: float = 10.0
    only: tuple[str, ...] = FAMILIES
    #: ``--dumps``: a run's Flight Recorder dump directory for ``--report`` (default: ./flight_recorder if fresh).
    dumps: str | None = None
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def selected(self, family: str) -> bool:
        """Whether the family ``family`` is to run."""
        return family in self.only
