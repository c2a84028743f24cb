"""The end of a multi-rank test job (torchrun-launched, or started by ``_pitfall_common``)."""

from __future__ import annotations

import os
import sys


def end_job() -> None:
    """Barrier, destroy the default process group, then leave the process at once with status 0.

    Call it last, once the job's results are written. Destroying the groups is not enough for gloo:
    its threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) outlive ``destroy_process_group`` (gdb on a
    rank of ``checkpoint_faults.py``, torch 2.13), because DeepSpeed's engine, its ZeRO-3 optimizer and
    every partitioned parameter (``ds_process_group``) still hold the groups until the interpreter tears
    them down. In that teardown a rank can abort ("terminate called without an active exception",
    SIGABRT) after its work is done, and the launcher then fails the launch: seen three times in CI, in
    a different job each time (the last after ``destroy_process_group``), never in 111 repeats of one job
    alone under a CPU burner. What the tests check is written before this point, so the job skips the
    teardown (``os._exit``). A user's script exits the normal way; ``benchmarks/clean_exit.py`` measures
    that path.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
