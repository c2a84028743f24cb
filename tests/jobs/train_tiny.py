"""Train the tiny MoE under ZeroMoEStrategy and record what every rank saw and held.

Run as a script (Lightning launches the other ranks by re-running it, and torchrun runs it once
per rank); the tests read the per-rank JSON it writes to --out:

    python tests/jobs/train_tiny.py --out DIR --steps 20 --ep-size 2 --devices 2
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule  # noqa: E402


class Recorder(L.Callback):
    """Per step: the sample indices this rank received and its losses. At start: what it holds."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.held: dict = {}

    def on_train_start(self, trainer, module) -> None:
        for name, p in trainer.strategy.deepspeed_engine.module.named_parameters():
            local = getattr(p, "ds_tensor", p)
            meta = getattr(p, "ds_autoep_uc_meta", None) or {}
            self.held[name] = {
                "ds_shape": list(getattr(p, "ds_shape", p.shape)),
                "local_numel": local.numel(),
                "local_experts": [int(e) for e in meta.get("local_experts", [])] or None,
                "local_sum": float(local.double().sum()),
            }

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps.append({"step": trainer.global_step, "indices": batch["index"].tolist(), **module.last_losses})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epoch-steps", type=int, default=10, help="steps per epoch (dataset size)")
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--aux-weight", type=float, default=0.01)
    parser.add_argument("--tie", action="store_true")
    parser.add_argument("--save", type=Path, help="save a checkpoint here after training")
    parser.add_argument("--ckpt-dir", type=Path, help="ModelCheckpoint directory (with --ckpt-every)")
    parser.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps")
    parser.add_argument("--resume", type=Path, help="resume from this checkpoint")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", args.devices))
    config = TinyMoEConfig(num_experts=args.num_experts, aux_loss_weight=args.aux_weight, tie_embeddings=args.tie)
    module = TinyMoEModule(config, batch_size=args.batch_size, num_samples=args.batch_size * world * args.epoch_steps)
    recorder = Recorder()
    callbacks = [recorder]
    if args.ckpt_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(args.ckpt_every),
        strategy=ZeroMoEStrategy(ep_size=args.ep_size, param_persistence_threshold=0), callbacks=callbacks)
    trainer.fit(module, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "steps": recorder.steps,
              "held": recorder.held, "strategy_config": trainer.strategy.config}
    # DeepSpeed's CPU all-reduce: whether it maps shared-memory buffers (every rank's on this host), and which of
    # this run's ranks' buffers are still in /dev/shm
    from lightning_zeromoe._private.deepspeed import comm_backend
    from lightning_zeromoe.engine.processes import shm_allreduce_buffer

    result["shm_allreduce"] = (getattr(comm_backend(), "shm_comm_op", None) is not None
                               and os.environ.get("LOCAL_SIZE") == str(trainer.world_size))
    result["shm_buffers_left"] = [buffer.name for r in range(trainer.world_size)
                                  if (buffer := shm_allreduce_buffer(r)).exists()]
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
