"""torch's Flight Recorder, always on, and a dump of it when a run hangs or a peer dies.

Every process group keeps a ring buffer of its recent collectives (sequence id, op, sizes, dtypes,
state, Python stack). ``TORCH_FR_BUFFER_SIZE`` sizes it; torch reads it in C++ when the recorder is
first used, i.e. when the first process group is created, so :func:`enable` runs before
``init_process_group`` (the strategy calls it in ``setup_environment``). Measured with torch 2.13 on
CPU (gloo): unset, a group keeps its last 2000 collectives; ``0`` turns recording off; ``10`` keeps 10.
The strategy sets it explicitly, so a torch whose default differs records too. The user's own
``TORCH_FR_*`` / ``TORCH_NCCL_TRACE_*`` settings win.

The dumps of one run live in one directory (the strategy's: ``<default_root_dir>/flight_recorder``),
laid out as :mod:`lightning_zeromoe.hang_dumps` says; NCCL's watchdog writes its own dumps there too
on a timeout, through ``TORCH_FR_DUMP_TEMP_FILE``. gloo's dump leaves out the groups' members, so the
process file records them, with the modules whose ZeRO-3 gathers ran last (:class:`GatherLog`).

A dump is written when a Trainer call raises (a collective timeout, a dead peer: the strategy's
``on_exception``), and on demand on ``SIGUSR1``: a thread woken through ``signal.set_wakeup_fd`` writes
it, so a rank whose main thread is stuck inside a collective still answers. A rank that dies of a fatal
error writes no dump; :mod:`faulthandler` writes its Python stacks instead (``stacks<N>.txt``).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Callable

from lightning_zeromoe import hang_dumps
from lightning_zeromoe.engine import group_exit

#: Entries per group's ring buffer when the strategy turns the recorder on: a ZeRO-3 step of a small
#: model issues a few hundred collectives, so this covers the last steps before a hang.
DEFAULT_BUFFER = 2000
#: Seconds a failing rank waits for the other ranks' traces (a rank that is alive answers in well under a
#: second; one that does not answer costs this much once, after the collective timeout itself).
PEER_DUMP_WAIT = 30.0
#: The user's settings that mean "I configured the recorder myself".
USER_SETTINGS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: Where torch's NCCL watchdog writes its dumps (prefix + rank).
DUMP_FILE_SETTINGS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_SIGNAL = hang_dumps.DUMP_SIGNAL


@dataclasses.dataclass
class FlightSettings:
    """What :func:`enable` decided: the buffer in force (0: off) and whether the user set it."""

    buffer: int
    users_own: bool
    directory: Path | None


def enable(buffer: int, directory: Path | None, env: dict[str, str] | None = None) -> FlightSettings:
    """Turn the recorder on for the groups this process will create (before any exists).

    ``buffer`` 0 turns it off (``TORCH_FR_BUFFER_SIZE=0``: measured, torch 2.13's gloo groups then record
    nothing). The user's
    ``TORCH_FR_BUFFER_SIZE`` (or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``) and ``TORCH_FR_DUMP_TEMP_FILE``
    are kept as they are.
    """
    env = os.environ if env is None else env
    users = next((env[name] for name in USER_SETTINGS if env.get(name)), None)
    if users is not None:
        return FlightSettings(int(users or 0), True, directory)
    env["TORCH_FR_BUFFER_SIZE"] = str(max(0, buffer))
    if buffer <= 0:
        return FlightSettings(0, False, directory)
    if directory is not None and not any(env.get(name) for name in DUMP_FILE_SETTINGS):
        env["TORCH_FR_DUMP_TEMP_FILE"] = str(directory / hang_dumps.TRACE_PREFIX)
    return FlightSettings(buffer, False, directory)


class GatherLog:
    """Which module each ZeRO-3 gather served: a forward pre-hook, placed before DeepSpeed's own (which
    fetches the module's partitioned parameters), notes the module's name and the time. The analysis
    names, for a diverging all-gather, the module whose fetch began last before it was issued.

    Only modules that hold partitioned parameters themselves get the hook; a bounded deque keeps the last
    ``size`` records (its cost: ``benchmarks/flight_recorder_cost.py``).
    """

    def __init__(self, size: int = DEFAULT_BUFFER) -> None:
        self.records: collections.deque[tuple[int, str]] = collections.deque(maxlen=size)
        self.handles: list[Any] = []

    def attach(self, model: Any, partitioned_only: bool = True) -> int:
        """Hook every module of ``model`` that owns ZeRO-3 partitioned parameters (``partitioned_only=False``:
        every module that owns parameters, as the benchmark does without ZeRO-3); returns how many."""
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if own and (not partitioned_only or any(hasattr(p, "ds_id") for p in own)):
                self.handles.append(module.register_forward_pre_hook(self._hook(name or "<model>"), prepend=True))
        return len(self.handles)

    def _hook(self, name: str) -> Callable[..., None]:
        records = self.records

        def note(_module: Any, _args: Any) -> None:
            records.append((time.time_ns(), name))
        return note

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@dataclasses.dataclass
class Recorder:
    """One rank's recorder state: where its dumps go and what it knows about its groups and gathers."""

    directory: Path
    rank: int
    world_size: int
    gathers: GatherLog = dataclasses.field(default_factory=GatherLog)
    #: One dump at a time: a failing main thread and the signal watcher (a peer asking) may dump at once.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _watcher: threading.Thread | None = None
    _sockets: tuple[socket.socket, socket.socket] | None = None
    _stacks: IO[str] | None = None

    def process_file(self) -> Path:
        return hang_dumps.process_file(self.directory, self.rank)

    def trace_file(self) -> Path:
        return hang_dumps.trace_file(self.directory, self.rank)

    def announce(self) -> None:
        """Write this rank's pid file, keep its Python stacks should it die of a fatal error, and listen for
        :data:`DUMP_SIGNAL` (call from the main thread)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._catch_fatal_errors()
        self._write_process_file(reason=None)
        self._listen()

    def _catch_fatal_errors(self) -> None:
        """A rank that aborts (gloo's size check on a mismatched collective ends the process from its I/O thread;
        NCCL's watchdog aborts on a timeout), segfaults or gets SIGBUS runs no Python and writes no trace.
        :mod:`faulthandler` writes every thread's Python stack to ``stacks<N>.txt`` from its C signal handler;
        the analysis reads the main thread's innermost collective and Lightning step there. A faulthandler the
        user (or ``PYTHONFAULTHANDLER``) turned on is left as it is."""
        if self._stacks is not None or (faulthandler.is_enabled() and _FATAL_STACKS.file is None):
            return
        self._stacks = hang_dumps.stacks_file(self.directory, self.rank).open("w")  # a new run: no stale stacks
        faulthandler.enable(file=self._stacks, all_threads=True)  # a later run in this process moves it to its own
        if _FATAL_STACKS.file is not None:
            _FATAL_STACKS.file.close()
        _FATAL_STACKS.file = self._stacks

    def dump(self, reason: str) -> Path | None:
        """Write this rank's trace and process file; returns the trace's path (None if torch cannot dump)."""
        from lightning_zeromoe._private import torch as torch_private

        if torch_private.flight_recorder_missing():
            return None
        with self._lock:
            data = torch_private.dump_flight_recorder()
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.trace_file()
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a reader never sees half a file
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self._write_process_file(reason=reason)
        return path

    def signal_peers(self, wait: float = 0.0) -> list[tuple[int, int, str]]:
        """Ask the other ranks of this run on this host for their dumps (before they are stopped, or while
        they wait in a collective), and wait up to ``wait`` seconds for them to answer. Only processes still
        running the same script get the signal."""
        return hang_dumps.request_and_wait(self.directory, wait, skip_rank=self.rank)

    def _write_process_file(self, reason: str | None) -> None:
        info = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "host": socket.gethostname(),
                "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "",
                "groups": _groups(), "dumped": reason, "time_ns": time.time_ns(),
                "main_thread": threading.main_thread().ident, "fatal_stacks": self._stacks is not None,
                "gathers": [list(r) for r in self.gathers.records]}
        tmp = self.directory / f".{self.process_file().name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.process_file())

    def _listen(self) -> None:
        if self._watcher is not None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(DUMP_SIGNAL) not in (signal.SIG_DFL, None):
            return  # the user handles SIGUSR1 themselves
        read_end, write_end = socket.socketpair()
        write_end.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
        except ValueError:
            return
        if previous != -1:  # someone else's wakeup fd (an event loop): leave it alone
            signal.set_wakeup_fd(previous)
            return
        self._sockets = (read_end, write_end)  # kept open for the process's life (the wakeup fd is write_end's)
        signal.signal(DUMP_SIGNAL, lambda *_: None)  # the C handler writes to the wakeup fd, in any thread
        # A peer's request that arrives while this interpreter shuts down must not kill it (SIGUSR1's default).
        atexit.register(signal.signal, DUMP_SIGNAL, signal.SIG_IGN)

        def watch() -> None:
            while True:
                data = read_end.recv(64)
                if not data:
                    return
                if DUMP_SIGNAL in data:
                    try:
                        self.dump("signal")
                    except Exception:  # noqa: BLE001 - a dump must never take the rank down
                        pass

        self._watcher = threading.Thread(target=watch, name="zeromoe-flight-recorder", daemon=True)
        self._watcher.start()


@dataclasses.dataclass
class _FatalStacks:
    """The file this process's faulthandler writes to, when the strategy turned it on (None: it did not)."""

    file: IO[str] | None = None


_FATAL_STACKS = _FatalStacks()


def _groups() -> dict[str, dict[str, Any]]:
    """Every group this rank is in: FR's group name -> description and global ranks."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        from lightning_zeromoe._private.torch import groups_of_this_rank

        return {str(pg.group_name): {"desc": getattr(pg, "group_desc", ""),
                                     "ranks": dist.get_process_group_ranks(pg)} for pg in groups_of_this_rank()}
    except Exception:  # noqa: BLE001 - best effort, during a failure
        return {}




class Flight:
    """The strategy's side of the recorder, one call per Lightning hook (the strategy stays thin), and of the
    groups' end at exit (:mod:`lightning_zeromoe.engine.group_exit`), whose failure this recorder reports.

    ``setting``: ``True`` (:data:`DEFAULT_BUFFER` entries per group), an int (that many), ``False`` (off).
    ``end_groups``: end the process groups when the process exits.
    """

    def __init__(self, setting: bool | int, end_groups: bool = True) -> None:
        self.buffer = (DEFAULT_BUFFER if setting else 0) if isinstance(setting, bool) else int(setting)
        self.end_groups = bool(end_groups)
        #: What :meth:`before_groups` decided, and this rank's recorder once the groups exist (None before).
        self.settings: FlightSettings | None = None
        self.recorder: Recorder | None = None

    def before_groups(self, trainer: Any) -> None:
        """``setup_environment``: torch reads ``TORCH_FR_BUFFER_SIZE`` when the first group is made."""
        root = Path(trainer.default_root_dir if trainer is not None else ".")
        self.settings = enable(self.buffer, root / "flight_recorder")

    def after_groups(self, rank: int, world_size: int, timeout: timedelta | None) -> None:
        """Once the groups exist: this rank's process file, listening for :data:`DUMP_SIGNAL`, and ending the
        groups at exit (not in teardown: a later validate/test/predict in the same script still needs them)."""
        if self.settings is not None and self.settings.buffer > 0 and self.settings.directory is not None:
            if self.recorder is None:
                self.recorder = Recorder(self.settings.directory, rank, world_size)
            self.recorder.announce()
        group_exit.end_groups_at_exit(timeout, enabled=self.end_groups, on_failure=self.dump)

    def attach(self, model: Any) -> None:
        """After ``deepspeed.initialize`` under ZeRO-3 (``model``: the engine's module; None: not ZeRO-3)."""
        if self.recorder is not None and model is not None:
            self.recorder.gathers.attach(model)

    def detach(self) -> None:
        if self.recorder is not None:
            self.recorder.gathers.detach()

    def dump(self, reason: str) -> Path | None:
        return self.recorder.dump(reason) if self.recorder is not None else None

    def failed(self, exception: BaseException, rank: int) -> None:
        """A Trainer call raised: this rank's trace, then the other ranks' (they may wait in a collective).
        This rank waits for their traces before its exception goes on: once it exits, Lightning's launcher
        stops the other ranks within seconds, and a rank stopped before it dumped leaves no trace. At exit,
        this rank will not wait for the others."""
        group_exit.mark_failed()
        try:
            path = self.dump(f"{type(exception).__name__}: {str(exception)[:300]}")
            if path is None or self.recorder is None:
                return
            self.recorder.signal_peers(wait=PEER_DUMP_WAIT)
        except Exception as error:  # noqa: BLE001 - the user's exception is what propagates, never ours
            print(f"[rank {rank}] Flight Recorder trace not written: {type(error).__name__}: {error}", file=sys.stderr,
                  flush=True)
            return
        print(f"[rank {rank}] Flight Recorder trace written to {path.parent}", file=sys.stderr, flush=True)


__all__ = ["DEFAULT_BUFFER", "DUMP_SIGNAL", "Flight", "FlightSettings", "GatherLog", "Recorder", "enable"]
