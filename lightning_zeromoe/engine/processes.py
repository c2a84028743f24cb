"""The processes a run lives in: DeepSpeed's CPU accelerator (and the shared-memory buffers its all-reduce
leaves in /dev/shm), collective timeouts on every group, and the ranks Lightning launched.

Used by :class:`~lightning_zeromoe.strategy.ZeroMoEStrategy`, and by the troubleshooter's
reproductions and tests (which import it lazily). The private torch calls live in
:mod:`lightning_zeromoe._private.torch`.
"""

from __future__ import annotations

import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch


def apply_timeout_to_all_groups(timeout: timedelta | None) -> int:
    """Give every process group this rank belongs to the strategy's collective timeout.

    DeepSpeed creates the expert-parallel and expert-data-parallel groups with
    ``torch.distributed.new_group(ranks)`` and no timeout, so they get the backend default
    (torch 2.13: 30 min for gloo, 10 min for NCCL), not the world group's. A rank stuck in an
    expert all-to-all would then wait for that default instead of ``timeout``. Returns how many
    groups were updated. The private torch calls live in :mod:`lightning_zeromoe._private.torch`.
    """
    if timeout is None or not torch.distributed.is_initialized():
        return 0
    from lightning_zeromoe._private import torch as _torch_private

    missing = _torch_private.missing_private_api()
    if missing:
        # Imported here: lightning.pytorch registers the strategy on import, which imports this module.
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"This torch lacks {', '.join(missing)}: expert-parallel groups keep the "
                       "backend's default collective timeout instead of ZeroMoEStrategy(timeout=...).")
        return 0
    groups = _torch_private.groups_of_this_rank()
    for group in groups:
        _torch_private.set_group_timeout(timeout, group)
    return len(groups)


def stop_launched_ranks(launcher: Any, grace: float) -> None:
    """When the launching rank fails, stop the ranks it started instead of leaving them behind.

    Lightning's script launcher kills its child ranks only on Ctrl+C. After any other error in
    rank 0 the children sit in a collective until the timeout, and DeepSpeed's CPU shared-memory
    comm op can spin forever waiting for a peer that is gone. Children that exit on their own
    within ``grace`` seconds (with their own error message) are left to do so.
    """
    procs = getattr(launcher, "procs", None) or []
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def group_timeout(group: Any) -> timedelta | None:
    """The collective timeout a process group's backend will use (for tests and the doctor)."""
    from lightning_zeromoe._private.torch import group_timeout as read

    return read(group)


def use_deepspeed_cpu_accelerator() -> None:
    """Point DeepSpeed at its CPU accelerator (gloo), even on a machine that has GPUs."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    if "LOCAL_SIZE" not in os.environ:
        # Without it, the CPU accelerator runs `numactl --hardware` in a subprocess every time it
        # counts devices: 5 times per ZeRO-3 step (measured, ~0.7 ms each). Count once, keep it.
        os.environ["LOCAL_SIZE"] = str(get_accelerator().device_count())


#: DeepSpeed's CPU shared-memory all-reduce (``ops/csrc/cpu/comm/shm.cpp``, ``shm_initialize``, 0.19.8): when every
#: rank is on one host (``LOCAL_SIZE`` equals the world size), each creates
#: ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (69 MB), maps every other
#: rank's, and never unlinks its own: every such run leaves them behind. These are the source lines that name it.
SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"
SHM_NAME_FORMATS = ('#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"', '"%s_%d_%s_%s"',
                    '"%s_%d", shm_name_prefix, rank')
SHM_DIR = Path("/dev/shm")


def shm_buffer_name_changes() -> list[str]:
    """What no longer holds of how the installed ``shm.cpp`` names its buffers (empty: all of it holds)."""
    import deepspeed

    source = Path(deepspeed.__file__).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp"
    if not source.is_file():
        return [f"{source} (the CPU shared-memory all-reduce's source, read for its buffer names)"]
    text = source.read_text(errors="replace")
    return [f"shm.cpp: {form}" for form in SHM_NAME_FORMATS if form not in text]


def shm_allreduce_buffer(rank: int) -> Path:
    """Where DeepSpeed's CPU all-reduce keeps ``rank``'s buffer in this run (MASTER_ADDR/PORT as it read them)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"{SHM_BUFFER_NAME}_{os.getuid()}_{addr}_{port}_{rank}"


def release_cpu_allreduce_buffer(rank: int) -> Path | None:
    """Remove this rank's name of DeepSpeed's CPU all-reduce buffer, if it made one; returns the path removed.

    First a barrier: ``shm_initialize`` maps every rank's buffer before ``init_distributed`` returns, so once
    all ranks are past it every buffer is mapped, and a mapping outlives its name (``shm_unlink`` removes only
    the name). Without the barrier a rank still looking the name up would wait for it forever. Call right after
    the process groups exist. Where there is no POSIX shared memory (Windows) DeepSpeed made no buffer.
    """
    from lightning_zeromoe.engine.collectives import barrier

    barrier()
    if not hasattr(os, "getuid") or not SHM_DIR.is_dir():
        return None
    path = shm_allreduce_buffer(rank)
    try:
        path.unlink()
    except (FileNotFoundError, PermissionError):
        return None
    return path


def device_memory_bytes(on_cpu: bool, device: torch.device, processes_per_node: int) -> float:
    """Memory per device for the planner: the GPU's, or on CPU this host's RAM shared by its processes."""
    if not on_cpu:
        return float(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, processes_per_node)


__all__ = ["apply_timeout_to_all_groups", "device_memory_bytes", "group_timeout", "release_cpu_allreduce_buffer",
           "shm_allreduce_buffer", "shm_buffer_name_changes", "stop_launched_ranks", "use_deepspeed_cpu_accelerator"]
