"""The end of a torchrun-launched test job."""

from __future__ import annotations


def end_process_group() -> None:
    """Barrier, then destroy the default process group, if one is up.

    A gloo group left to the interpreter's exit can abort a rank ("terminate called without an active
    exception", SIGABRT) after the job's work is done, and torchrun then fails the launch.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
