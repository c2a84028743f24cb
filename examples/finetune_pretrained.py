"""Fine-tune a pretrained Hugging Face MoE with ZeRO-3 + expert parallelism, end to end.

    python examples/finetune_pretrained.py --workdir runs/finetune            # 2 CPU processes
    python examples/finetune_pretrained.py --workdir runs/finetune --accelerator gpu --devices 8 --ep-size 8

Steps (each prints one line starting with ``[step]``):

1. **pretrained**: a tiny Mixtral is built from a config and saved with ``save_pretrained`` (stands
   in for a downloaded model; nothing is downloaded here). Use your own directory or hub id with
   ``--pretrained``.
2. **train**: ``configure_model`` calls ``AutoModelForCausalLM.from_pretrained``. Under
   ``ZeroMoEStrategy`` that runs inside ``deepspeed.zero.Init``: each rank loads only its ZeRO-3
   partition of every weight; AutoEP splits the experts over ``ep_size`` ranks when the engine is
   built. The first training loss is checked against the pretrained model's loss on the same
   batch, computed without any of this (proof that the weights were loaded, not initialised).
3. **validate**: ``trainer.validate`` on the held-out batches, after ``fit``.
4. **export**: ``trainer.save_checkpoint`` writes DeepSpeed's shards; ``lightning_zeromoe.checkpoint.export``
   (the ``zeromoe-export CKPT_DIR OUT_DIR`` command) turns them into a Hugging Face directory.
5. **reload**: ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` in a plain process, evaluated on
   the same validation batches: its loss equals step 3's.

``--through`` stops after a step (``train``, ``validate``, ``export``; default: everything).
The last line is ``[result] {...}`` (JSON) with the numbers the checks used; every rank also writes
them to ``WORKDIR/result_rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

STEPS = ("train", "validate", "export", "reload")
#: How close the losses of two implementations of the same computation must be (fp32).
RTOL = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="where the model, checkpoint and export go")
    parser.add_argument("--pretrained", default=None, help="an HF directory or hub id (default: save a tiny Mixtral)")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--through", choices=STEPS, default="reload", help="stop after this step")
    return parser.parse_args(argv)


def save_tiny_mixtral(path: Path) -> None:
    """A 2-layer, 4-expert Mixtral (vocab 128), saved the way a downloaded checkpoint is stored."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                           tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(path)


def datasets(vocab: int, n_train: int, n_val: int) -> tuple[Any, Any]:
    from lightning_zeromoe.reference.models import SyntheticLMData

    train = SyntheticLMData(num_samples=n_train, seq_len=17, vocab_size=vocab, seed=0)
    val = SyntheticLMData(num_samples=n_val, seq_len=17, vocab_size=vocab, seed=1)
    return train, val


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The HF model's own loss: next-token cross-entropy plus its router aux loss."""
    return model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False).loss


def make_module(pretrained: str, train: Any, val: Any, batch_size: int, lr: float) -> Any:
    import lightning as L
    from torch.utils.data import DataLoader

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.first_batch: list[int] | None = None
            self.first_loss: float | None = None
            self.train_losses: list[float] = []

        def configure_model(self) -> None:
            # Called once the strategy is ready: under ZeroMoEStrategy this is inside zero.Init.
            if self.model is None:
                from transformers import AutoModelForCausalLM

                self.model = AutoModelForCausalLM.from_pretrained(pretrained)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = lm_loss(self.model, batch["input_ids"])
            if self.first_loss is None:
                self.first_batch, self.first_loss = [int(i) for i in batch["index"]], float(loss.detach())
            self.train_losses.append(float(loss.detach()))
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            loss = lm_loss(self.model, batch["input_ids"])
            self.log("val_loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(train, batch_size=batch_size, shuffle=False, drop_last=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(val, batch_size=batch_size, shuffle=False, drop_last=True)

    return FineTune()


def plain_eval(model: torch.nn.Module, val: Any, batch_size: int, world: int) -> float:
    """Mean validation loss as Lightning computes it: per batch on each rank, averaged over all."""
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(val) - batch_size * world + 1, batch_size * world):
            for rank in range(world):
                # DistributedSampler without shuffling: rank r gets samples r, r + world, ...
                idx = list(range(start + rank, start + batch_size * world, world))
                losses.append(lm_loss(model, val.tokens[idx]).item())
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = STEPS.index(args.through)
    import lightning as L
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_zeromoe import ZeroMoEStrategy

    workdir = args.workdir
    pretrained = args.pretrained or str(workdir / "pretrained")
    L.seed_everything(0, verbose=False)
    result: dict[str, Any] = {}
    is_launcher = "LOCAL_RANK" not in __import__("os").environ
    if args.pretrained is None and is_launcher and not (workdir / "pretrained" / "config.json").exists():
        save_tiny_mixtral(workdir / "pretrained")
    vocab = AutoConfig.from_pretrained(pretrained).vocab_size
    world = args.devices
    train, val = datasets(vocab, n_train=args.batch_size * world * args.steps, n_val=args.batch_size * world * 2)

    # 2. train ----------------------------------------------------------------------------------
    module = make_module(pretrained, train, val, args.batch_size, args.lr)
    trainer = L.Trainer(accelerator=args.accelerator, devices=world, precision=args.precision,
                        strategy=ZeroMoEStrategy(ep_size=args.ep_size), max_steps=args.steps, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        num_sanity_val_steps=0, log_every_n_steps=1, enable_progress_bar=False)
    trainer.fit(module)
    fit_val = float(trainer.callback_metrics["val_loss"])
    # The same first batch through the untouched pretrained weights, in this process, no DeepSpeed.
    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    with torch.no_grad():
        pretrained_loss = lm_loss(reference, train.tokens[module.first_batch]).item()
    del reference
    result.update(rank=trainer.global_rank, first_loss=module.first_loss, pretrained_loss=pretrained_loss,
                  train_losses=module.train_losses, fit_val_loss=fit_val)
    if not math.isclose(module.first_loss, pretrained_loss, rel_tol=RTOL):
        raise SystemExit(f"step-1 loss {module.first_loss} != the pretrained model's {pretrained_loss}: "
                         "the weights were not loaded")
    if trainer.is_global_zero:
        print(f"[train] {args.steps} steps, loss {module.train_losses[0]:.4f} -> {module.train_losses[-1]:.4f}; "
              f"step-1 loss equals the pretrained model's ({pretrained_loss:.6f}); val_loss {fit_val:.4f}", flush=True)

    # The checkpoint of the trained model: saved before validate, whose engine holds no optimizer.
    ckpt, out_dir = workdir / "checkpoint", workdir / "exported"
    if stop >= STEPS.index("export"):
        trainer.save_checkpoint(ckpt, weights_only=False)

    # 3. validate ---------------------------------------------------------------------------------
    if stop >= STEPS.index("validate"):
        metrics = trainer.validate(module, verbose=False)[0]
        result["val_loss"] = float(metrics["val_loss"])
        if trainer.is_global_zero:
            print(f"[validate] val_loss {result['val_loss']:.6f} (end of fit: {fit_val:.6f})", flush=True)

    # 4. export to a Hugging Face directory -------------------------------------------------------
    if stop >= STEPS.index("export"):
        from lightning_zeromoe.checkpoint import export

        if trainer.is_global_zero:
            export(ckpt, out_dir, overwrite=True, progress=False)
            print(f"[export] {ckpt} -> {out_dir} (same as: zeromoe-export {ckpt} {out_dir})", flush=True)
        trainer.strategy.barrier()

        # 5. reload: a plain process's view of the exported directory ------------------------------
        if stop >= STEPS.index("reload") and trainer.is_global_zero:
            reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
            result["reloaded_val_loss"] = plain_eval(reloaded, val, args.batch_size, world)
            want = result.get("val_loss", fit_val)
            if not math.isclose(result["reloaded_val_loss"], want, rel_tol=RTOL):
                raise SystemExit(f"the exported model's val_loss {result['reloaded_val_loss']} != the trained "
                                 f"model's {want}")
            print(f"[reload] from_pretrained({out_dir}): val_loss {result['reloaded_val_loss']:.6f}, "
                  "equal to the trained model's", flush=True)
    # Every rank writes what it checked: a rank that fails leaves no file behind.
    (workdir / f"result_rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if trainer.is_global_zero:
        print(f"[result] {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    from lightning_zeromoe.engine.notices import silence_known_notices

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    silence_known_notices()
    raise SystemExit(main(sys.argv[1:]))
