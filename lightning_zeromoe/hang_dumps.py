"""A run's Flight Recorder dump directory: its files, and how to ask the ranks for a fresh dump.

Standard library only: the training side (:mod:`lightning_zeromoe.engine.flight_recorder`) writes
these files, and ``troubleshooter hang-dump`` / ``explain`` read them without loading torch.

* ``rank<N>``: rank N's Flight Recorder dump (torch's pickle format, what ``fr_trace`` reads);
* ``process<N>.json``: rank N's pid, host and script, the groups it is in with their global ranks,
  why and when it last dumped, and the modules its last ZeRO-3 gathers served;
* ``stacks<N>.txt``: rank N's Python stacks if it died of a fatal error (an abort, a segfault, a bus
  error), written by :mod:`faulthandler`; empty while it lives. A rank that dies that way writes no
  trace, and these stacks are then its only account of the collective it was in.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

TRACE_PREFIX = "rank"
PROCESS_PREFIX = "process"
STACKS_PREFIX = "stacks"
TRACE = re.compile(rf"^{TRACE_PREFIX}(\d+)$")
PROCESS = re.compile(rf"^{PROCESS_PREFIX}(\d+)\.json$")
STACKS = re.compile(rf"^{STACKS_PREFIX}(\d+)\.txt$")
#: The signal that asks a rank for its dump (the strategy listens for it).
DUMP_SIGNAL = signal.SIGUSR1


def trace_file(directory: Path, rank: int) -> Path:
    return directory / f"{TRACE_PREFIX}{rank}"


def process_file(directory: Path, rank: int) -> Path:
    return directory / f"{PROCESS_PREFIX}{rank}.json"


def stacks_file(directory: Path, rank: int) -> Path:
    return directory / f"{STACKS_PREFIX}{rank}.txt"


def read_fatal_stacks(directory: Path) -> dict[int, str]:
    """Rank -> the text :mod:`faulthandler` wrote when that rank died of a fatal error (empty files skipped)."""
    found = {}
    for path in directory.iterdir():
        if (match := STACKS.match(path.name)) is None:
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if text.strip():
            found[int(match.group(1))] = text
    return found


def is_dump_dir(path: Path) -> bool:
    """Whether ``path`` is a directory holding at least one rank's trace or process file. ``explain``
    also takes the error message itself as its argument: a long message is no path at all
    (``OSError: File name too long``), and then this is False."""
    try:
        return path.is_dir() and any(TRACE.match(p.name) or PROCESS.match(p.name) for p in path.iterdir())
    except (OSError, ValueError):
        return False


def read_processes(directory: Path) -> dict[int, dict[str, Any]]:
    """Rank -> its process file's contents (unreadable files are skipped)."""
    found = {}
    for path in directory.iterdir():
        if (match := PROCESS.match(path.name)) is None:
            continue
        try:
            found[int(match.group(1))] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def runs_script(pid: int, script: str) -> bool:
    """Whether process ``pid`` is alive and runs ``script`` (a stale pid file must not hit another process)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(script) and any(Path(arg.decode(errors="replace")).name == script for arg in cmdline)


def request_dumps(directory: Path, skip_rank: int | None = None) -> list[tuple[int, int, str]]:
    """Send :data:`DUMP_SIGNAL` to every rank of this host whose process file is in ``directory``.

    Returns ``(rank, pid, outcome)`` per rank: ``"sent"``, ``"gone"`` (not running that script any
    more) or ``"other host"``.
    """
    host = socket.gethostname()
    done = []
    for rank, info in sorted(read_processes(directory).items()):
        pid = int(info.get("pid", 0))
        if rank == skip_rank or pid == os.getpid():
            continue
        if info.get("host") != host:
            done.append((rank, pid, "other host"))
        elif not runs_script(pid, str(info.get("script", ""))):
            done.append((rank, pid, "gone"))
        else:
            try:
                os.kill(pid, DUMP_SIGNAL)
                done.append((rank, pid, "sent"))
            except (ProcessLookupError, PermissionError):
                done.append((rank, pid, "gone"))
    return done


def request_and_wait(directory: Path, wait: float, skip_rank: int | None = None) -> list[tuple[int, int, str]]:
    """Signal the ranks whose process files are in ``directory`` (:func:`request_dumps`), then wait up to
    ``wait`` seconds until each signalled rank's trace has been rewritten.

    ``troubleshooter hang-dump`` uses it, and so does a failing rank before it lets its exception go: once
    one rank exits, Lightning's launcher SIGKILLs the others within seconds, and a peer killed before it
    answered leaves no trace (measured: the uneven-batches hang lost rank 0's trace that way, now and then,
    on two busy cores). Returns :func:`request_dumps`'s list, with ``"no dump within the wait"`` for a
    signalled rank that did not answer in time.
    """
    before = {rank: _mtime(trace_file(directory, rank)) for rank in read_processes(directory)}
    sent = request_dumps(directory, skip_rank=skip_rank)
    waiting = {rank for rank, _, outcome in sent if outcome == "sent"}
    deadline = time.monotonic() + wait
    while waiting:
        waiting = {rank for rank in waiting if _mtime(trace_file(directory, rank)) in (None, before.get(rank))}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return [(rank, pid, "no dump within the wait" if rank in waiting else outcome) for rank, pid, outcome in sent]


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


__all__ = ["DUMP_SIGNAL", "PROCESS", "STACKS", "TRACE", "is_dump_dir", "process_file", "read_fatal_stacks",
           "read_processes", "request_and_wait", "request_dumps", "runs_script", "stacks_file", "trace_file"]
