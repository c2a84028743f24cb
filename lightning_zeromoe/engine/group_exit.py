"""Ending the process groups when the process exits, so a finished script exits 0.

A gloo or NCCL group left to the interpreter's own shutdown is destroyed in C++ static destruction,
after Python has stopped: its threads can then be torn down in the wrong order and the process
aborts ("terminate called without an active exception", SIGABRT, exit code 134) after the work is
done; NCCL warns that the group was not destroyed. Measured with ``benchmarks/clean_exit.py``.

Why at exit and not in ``Strategy.teardown``: Lightning calls ``teardown`` at the end of every
``fit``, ``validate``, ``test`` and ``predict``, and a script commonly calls several of them in a
row (or ``trainer.save_checkpoint`` after ``fit``). The world group, and the expert groups DeepSpeed
caches in ``deepspeed.utils.groups``, must still work for the next call: a group destroyed in
``teardown`` would leave DeepSpeed holding dead handles and Lightning re-creating the world group
on a port the first rendezvous used. The one point after which nothing of ours can run is the
interpreter's exit, so the strategy registers :func:`end_groups_at_exit` with :mod:`atexit` when it
creates the groups. ``atexit`` runs handlers last-registered-first, so this runs before torch's
and DeepSpeed's own exit handlers, while every group is still intact.

A run that ended with an exception does not wait for its peers at exit (they may be dead or stuck):
it leaves the groups to the process's end, as before, and its exit code is non-zero either way.
A user who destroys the groups themselves finds nothing left to do here.
"""

from __future__ import annotations

import atexit
import dataclasses
from datetime import timedelta
from typing import Callable


@dataclasses.dataclass
class ExitState:
    """What the exit handler needs: whether to end the groups, how long to wait for peers, and
    whether the last Trainer call of this process failed."""

    enabled: bool = True
    timeout: timedelta | None = None
    failed: bool = False
    registered: bool = False
    #: Called with the error when the exit barrier fails (a peer died or hung): the Flight Recorder's dump.
    on_failure: Callable[[str], object] | None = None


#: One per process: the strategies of successive Trainers update it; the handler reads it once, at exit.
STATE = ExitState()


def end_groups_at_exit(timeout: timedelta | None, enabled: bool = True,
                       on_failure: Callable[[str], object] | None = None) -> None:
    """Arrange for this process's groups to end cleanly when it exits (once per process; later calls
    update the timeout, the switch and what runs when the exit barrier fails)."""
    STATE.enabled, STATE.timeout, STATE.failed, STATE.on_failure = enabled, timeout, False, on_failure
    if not STATE.registered:
        atexit.register(_end_groups)
        STATE.registered = True


def mark_failed() -> None:
    """The current Trainer call raised: at exit, do not wait for the other ranks."""
    STATE.failed = True


def _end_groups() -> None:
    if not STATE.enabled or STATE.failed:
        return
    from lightning_zeromoe.engine.collectives import end_all_groups

    try:
        end_all_groups(wait=True, timeout=STATE.timeout)
    except Exception as error:  # a peer already gone: nothing left to protect, say so and exit
        import sys

        print(f"lightning_zeromoe: process groups not ended cleanly at exit ({error})", file=sys.stderr)
        if STATE.on_failure is not None:
            try:
                STATE.on_failure(f"exit barrier: {type(error).__name__}: {str(error)[:300]}")
            except Exception:  # noqa: BLE001 - exiting anyway
                pass


__all__ = ["ExitState", "STATE", "end_groups_at_exit", "mark_failed"]
