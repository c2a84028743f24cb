"""Faults injected into real checkpoint writes: a rank SIGKILLed mid-save, rank 0 SIGKILLed
mid-conversion, a rank whose disk is full. Launched with ``torchrun --nproc_per_node 2``.

The injection is the test's, not the product's: the kill rank wraps the function that writes the
files (``torch.save`` under DeepSpeed's checkpoint engine, ``add_target_names`` in the universal
conversion) so that the process sends itself SIGKILL at that point, as a node failure or the OOM
killer would. The disk-full case sets ``RLIMIT_FSIZE`` on one rank (with SIGXFSZ ignored, writes
past the limit fail with ``EFBIG``, as on a full disk).

Modes (``--mode``):

* ``save-killed``: train, save ``--ckpt`` (complete), then save it again while rank 1 is killed
  after writing part of its files (the fixed-path ``last.ckpt`` pattern);
* ``save``: the same command without the fault: train, save ``--ckpt``, write ``saved.json``;
  then, with ``--disk-full DIR``, save DIR while rank 1 has a 64 KiB file-size limit;
* ``resume-killed``: resume ``--ckpt`` with ``ep_size=1`` (a universal conversion on rank 0), rank 0
  killed while the converted tensors are being renamed;
* ``resume``: the same without the fault, one more step; writes ``resumed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEModule  # noqa: E402

from _teardown import end_job  # noqa: E402  (tests/jobs: the script's own directory)

STEPS = 2


def _trainer(ep_size: int, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     strategy=ZeroMoEStrategy(ep_size=ep_size, timeout=timedelta(seconds=60)))


def _kill_self_on(module: object, name: str, after: int) -> None:
    """Replace ``module.name`` so that its call number ``after`` (0-based) SIGKILLs this process
    (after the earlier calls did their real work)."""
    real = getattr(module, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        if calls[0] == after:
            print(f"[fault] rank {dist.get_rank()}: SIGKILL in {name} (call {after})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, wrapper)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("save-killed", "save", "resume-killed", "resume"), required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--disk-full", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = TinyMoEModule(batch_size=4, num_samples=64)
    if args.mode in ("save-killed", "save"):
        trainer = _trainer(2, STEPS)
        trainer.fit(module)
        trainer.save_checkpoint(args.ckpt)
        if args.mode == "save-killed":
            if rank == 1:
                from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine

                _kill_self_on(torch_checkpoint_engine.torch, "save", after=1)  # after its model states
            trainer.save_checkpoint(args.ckpt)
        elif args.disk_full is not None:
            if rank == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
            trainer.save_checkpoint(args.disk_full)
    else:
        if args.mode == "resume-killed" and rank == 0:
            from lightning_zeromoe.checkpoint.resume import universal_names

            _kill_self_on(universal_names, "_copytree_atomic", after=1)
        trainer = _trainer(1, STEPS + 1)
        trainer.fit(module, ckpt_path=args.ckpt)
        if rank == 0:
            (args.ckpt.parent / "resumed.json").write_text(json.dumps({"step": trainer.global_step}))
    end_job()


if __name__ == "__main__":
    main()
