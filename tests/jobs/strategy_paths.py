"""Several training paths of ZeroMoEStrategy in one launch, each a real Trainer.fit on 2 CPU ranks.

Run under torchrun (one launch, several fits: the process group and DeepSpeed's expert groups
are created once and reused, as in a notebook that fits twice)::

    python -m torch.distributed.run --nproc_per_node 2 tests/jobs/strategy_paths.py --out DIR --runs s2_sched,auto

or as two one-process "nodes" (``--nnodes 2 --node_rank i``) with ``--num-nodes 2 --devices 1``.
Per run and rank it writes ``DIR/<run>/rank<R>.json``: the sample indices and loss of every
training micro-batch, the chosen stage, the parameters' dtypes, the optimizer's param groups,
and (for the ``*_val`` runs) the per-batch validation losses after fit and from a checkpoint
loaded into a fresh Trainer. ``tests/test_strategy_paths.py`` compares them with plain
single-process runs.

Runs (name: what it does):
  s2_sched     stage=2, ep_size=2, torch AdamW + LambdaLR warm-up from configure_optimizers
  auto         stage="auto" (the planner picks stage 1 for the tiny model), ep_size=2
  accum_clip   stage=3, ep_size=2, accumulate_grad_batches=2, gradient_clip_val=0.05
  bf16_true    stage=3, ep_size=2, precision="bf16-true"
  bf16_mixed   stage=3, ep_size=2, precision="bf16-mixed"
  s3_val       stage=3, ep_size=2: fit, save; validate, test, predict after fit; fresh Trainer validate(ckpt_path=...)
  native_s1    native deepspeed.moe.layer.MoE (ep_size=2 in the layers), stage="auto" (the planner, given the
               layers' ep_size, picks 1; never 3), ZeroMoEStrategy's ep_size left unset (taken from the layers)
  native_s2    the same at stage=2 with ZeroMoEStrategy(ep_size=2)
  grouped      stage=3, ep_size=1, grouped_experts=True (AutoEP's layer, autoep_size=1): fit, save; a fresh
               Trainer with other initial weights resumes from the checkpoint for 2 more steps
  nodes        stage=3, ep_size=2 (for the two-"node" launch)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from native_moe import NativeMoEModule  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoEModule, lm_losses  # noqa: E402

BATCH, LR, WARMUP = 4, 3e-3, 3
VAL_SAMPLES = 16


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


class PathModule(TinyMoEModule):
    """The tiny MoE with an optional warm-up scheduler and a validation set."""

    def __init__(self, *args, scheduler: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.use_scheduler = scheduler
        self.val_losses: list[dict] = []

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def val_dataloader(self):
        data = SyntheticLMData(VAL_SAMPLES, self.model.config.max_seq_len // 2 + 1, self.model.config.vocab_size,
                               seed=0)
        return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)

    def _eval_loss(self, batch) -> torch.Tensor:
        task, aux = lm_losses(self.model, batch["input_ids"])
        return (task + self.model.config.aux_loss_weight * aux).mean()

    def validation_step(self, batch, batch_idx):
        loss = self._eval_loss(batch)
        self.val_losses.append({"indices": batch["index"].tolist(), "loss": float(loss)})
        self.log("val/loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return {"indices": batch["index"].tolist(), "loss": float(self._eval_loss(batch))}


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.facts: dict = {}

    def on_train_start(self, trainer, module) -> None:
        engine = trainer.strategy.deepspeed_engine
        optimizer = engine.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        self.facts = {
            "stage": trainer.strategy.config["zero_optimization"]["stage"],
            "dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "groups": [{"moe": bool(g.get("moe")), "name": g.get("name"), "n": len(g["params"])}
                       for g in inner.param_groups],
            "expert_parallel": trainer.strategy.config.get("expert_parallel", {}).get("enabled", False),
            "has_expert_parallel_section": "expert_parallel" in trainer.strategy.config,
            "strategy_ep_size": trainer.strategy.resolved.ep_size,
            "ep_size_given": trainer.strategy.ep_size_given,
            "native_local_experts": {n: int(m.num_local_experts) for n, m in engine.module.named_modules()
                                     if type(m).__module__ == "deepspeed.moe.layer"},
            "autoep_layers": autoep_layers(engine.module),
            "held": {n: [getattr(p, "ds_tensor", p).numel(), list(getattr(p, "ds_shape", p.shape))]
                     for n, p in engine.module.named_parameters() if ".experts." in n},
        }

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        indices = batch["index"].tolist() if isinstance(batch, dict) else batch[1].tolist()
        self.steps.append({"step": trainer.global_step, "indices": indices, "loss": module.last_losses["loss"],
                           "lr": trainer.optimizers[0].param_groups[0]["lr"]})


def autoep_layers(module: torch.nn.Module) -> dict[str, dict]:
    """Every AutoEP layer in the engine's module: its ep_size and how many experts it holds."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return {n: {"ep_size": int(m.ep_size), "local_experts": int(m.num_local_experts)}
            for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)}


def trainer_for(args: argparse.Namespace, strategy: ZeroMoEStrategy, steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, max_steps=steps,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, strategy=strategy, num_sanity_val_steps=0,
                     limit_val_batches=0 if "val" not in kwargs.pop("_name", "") else None, **kwargs)


def one_run(name: str, args: argparse.Namespace, world: int) -> dict:
    L.seed_everything(0, verbose=False)
    steps = args.steps
    trainer_kwargs: dict = {"_name": name}
    strategy_kwargs: dict = {"ep_size": 2, "param_persistence_threshold": 0}
    epoch_steps = steps
    if name.startswith("native"):
        module = NativeMoEModule(ep_size=2, batch_size=BATCH, num_samples=BATCH * world * steps, lr=LR)
        strategy_kwargs = {"stage": "auto"} if name == "native_s1" else {"stage": 2, "ep_size": 2}
    else:
        if name == "accum_clip":
            trainer_kwargs.update(accumulate_grad_batches=2, gradient_clip_val=0.05)
            epoch_steps = 2 * steps
        if name.startswith("bf16"):
            trainer_kwargs["precision"] = name.replace("_", "-")
        if name == "s2_sched":
            strategy_kwargs["stage"] = 2
        if name == "auto":
            strategy_kwargs["stage"] = "auto"
        if name == "grouped":
            strategy_kwargs.update(ep_size=1, grouped_experts=True)
        module = PathModule(TinyMoEConfig(), batch_size=BATCH, num_samples=BATCH * world * epoch_steps, lr=LR,
                            scheduler=name == "s2_sched")
    recorder = Recorder()
    trainer = trainer_for(args, ZeroMoEStrategy(**strategy_kwargs), steps, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(module)
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "steps": recorder.steps,
              **recorder.facts}
    if name.endswith("_val"):
        ckpt = args.out / name / "ckpt"
        trainer.save_checkpoint(ckpt)
        module.val_losses.clear()
        trainer.validate(module, verbose=False)
        result["val_after_fit"] = list(module.val_losses)
        module.val_losses.clear()
        trainer.test(module, dataloaders=module.val_dataloader(), verbose=False)
        result["test_after_fit"] = list(module.val_losses)
        result["predict_after_fit"] = trainer.predict(module, dataloaders=module.val_dataloader())
        try:  # the evaluation engine holds no optimizer: a clear error, not DeepSpeed's AttributeError
            trainer.save_checkpoint(args.out / name / "after_eval")
            result["save_after_eval"] = "saved"
        except RuntimeError as err:
            result["save_after_eval"] = str(err)
        L.seed_everything(1, verbose=False)  # other initial weights: only the checkpoint can make them equal
        fresh = PathModule(TinyMoEConfig(), batch_size=BATCH, num_samples=BATCH * world * steps, lr=LR)
        fresh_trainer = trainer_for(args, ZeroMoEStrategy(ep_size=2, param_persistence_threshold=0), steps,
                                    _name=name)
        fresh_trainer.validate(fresh, ckpt_path=ckpt, verbose=False)
        result["val_from_ckpt"] = list(fresh.val_losses)
    if name == "grouped":  # save, then resume into a fresh Trainer and module with other initial weights
        ckpt = args.out / name / "ckpt"
        trainer.save_checkpoint(ckpt)
        result["ckpt"] = str(ckpt)
        L.seed_everything(1, verbose=False)
        fresh = PathModule(TinyMoEConfig(), batch_size=BATCH, num_samples=BATCH * world * epoch_steps, lr=LR)
        resumed = Recorder()
        trainer_for(args, ZeroMoEStrategy(**strategy_kwargs), steps + 2, callbacks=[resumed],
                    _name=name).fit(fresh, ckpt_path=ckpt)
        result["resumed_steps"] = resumed.steps
        result["resumed_layers"] = resumed.facts["autoep_layers"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True, help="comma-separated run names (see the module docstring)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", args.devices * args.num_nodes))
    for name in args.runs.split(","):
        start = time.perf_counter()
        result = one_run(name, args, world)
        (args.out / name).mkdir(parents=True, exist_ok=True)
        (args.out / name / f"rank{result['rank']}.json").write_text(json.dumps(result))
        print(f"run {name}: done on rank {result['rank']} in {time.perf_counter() - start:.1f} s", flush=True)
    from _teardown import end_job  # tests/jobs: the script's own directory

    end_job()


if __name__ == "__main__":
    main()
