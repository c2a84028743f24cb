"""PEFT LoRA on attention (q_proj, v_proj) of a tiny Mixtral, base weights and experts frozen, under
``ZeroMoEStrategy(ep_size=2)`` (ZeRO-3): save, resume on the same and on other shapes, export.

Launched with ``torchrun --nproc_per_node 2`` (one process group, several Trainers in a row).
Global batch 4 (2 per rank), 2 steps per epoch, ``shuffle=False``: every resume starts at an
epoch boundary, so the resumed steps see the batches the uninterrupted run saw.

* ``A``: seed 0, ``ep_size=2``, 6 steps; ``ModelCheckpoint`` saves steps 2, 4 and 6 (``A/ckpt``).
  After ``fit``, the engine's logits on a fixed batch (the reference for the export of step 6).
* ``B``: a model built with seed 1 (other weights everywhere) resumes ``A@2`` with ``ep_size=2``
  (same shape), steps 3-4.
* ``C``: seed 1 resumes ``A@2`` with ``ep_size=1`` (no AutoEP: universal path, AutoEP -> the
  model's own fused experts), steps 3-4; saves step 4 (``C/ckpt``).
* ``D``: seed 1 resumes ``C@4`` with ``ep_size=2`` (none -> AutoEP), steps 5-6.
* ``E``: seed 1 resumes ``A@2`` with ``ep_size=1, grouped_experts=True`` (AutoEP's layer holding all
  4 experts on both ranks: one expert-data-parallel group of 2), step 3, and saves it: one file,
  written by one rank.

LoRA on the fused 3-D expert tensors too (PEFT ``target_parameters``: both MoE blocks fall back to
ZeRO-3 leaf modules, see ``discovery/peft_blocks.py``):

* ``T``: seed 0, ``ep_size=2``, 4 steps; saves steps 2 and 4 (``T/ckpt``); after ``fit``, every
  parameter gathered (``T/params_end.pt``, rank 0) and the engine's logits on the fixed batch.
* ``U``: seed 1 resumes ``T@2`` with ``ep_size=2`` (same shape), steps 3-4.
* ``V``: seed 1 resumes ``T@2`` with ``ep_size=1`` (another shape), step 3.

The path real users take (``P``): the seed-0 model written with ``save_pretrained`` (``P/pretrained``,
by rank 0), loaded with ``from_pretrained`` inside ``configure_model`` (ZeRO-3 ``zero.Init``: every
parameter partitioned as it is built) and wrapped there with ``get_peft_model`` (LoRA initialised
from seed ``PRETRAINED_LORA_SEED``), ``ep_size=2``, 2 steps; saves step 2 (``P/ckpt``); at the start
of training every trainable parameter gathered (``P/lora_start.pt``, rank 0); after ``fit`` the
engine's logits on the fixed batch.

Each resumed run writes, right after the load (``on_train_start``), every frozen parameter it
holds (gathered; AutoEP layers' local expert ids with them) to ``<run>/frozen_rank<R>.pt``. Every
run writes ``<run>/rank<R>.json``: per step the global step, the sample indices this rank got
and its loss; which parameters trained before and after ``fit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
for extra in (REPO, REPO / "tests" / "jobs"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData  # noqa: E402
from train_hf import VOCAB, build_hf_model  # noqa: E402

SAMPLES, PER_RANK, SEQ, LR = 8, 2, 17, 1e-2
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


#: Runs ``T``, ``U``, ``V``: LoRA on the fused 3-D expert tensors too (PEFT ``target_parameters``).
LORA_EXPERTS = dict(LORA, target_parameters=["experts.gate_up_proj", "experts.down_proj"])


def lora_model(seed: int, experts: bool = False) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    L.seed_everything(seed, verbose=False)
    return get_peft_model(build_hf_model("mixtral"), LoraConfig(**(LORA_EXPERTS if experts else LORA)))


#: Run ``P``: the seed LoRA's initial values are drawn from, right before ``get_peft_model``.
PRETRAINED_LORA_SEED = 7


def pretrained_lora_model(path: Path) -> torch.nn.Module:
    """``from_pretrained(path)`` wrapped with LoRA drawn from ``PRETRAINED_LORA_SEED`` (also the plain reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path)
    L.seed_everything(PRETRAINED_LORA_SEED, verbose=False)
    return get_peft_model(base, LoraConfig(**LORA))


def fixed_batch() -> torch.Tensor:
    return SyntheticLMData(num_samples=2, seq_len=SEQ - 1, vocab_size=VOCAB, seed=1234).tokens


class LoraModule(L.LightningModule):
    def __init__(self, net: torch.nn.Module, capture: Path | None = None, capture_end: Path | None = None) -> None:
        super().__init__()
        self.net = net
        self.pretrained: Path | None = None
        self.capture = capture
        self.capture_end = capture_end
        self.steps: list[dict[str, Any]] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        loss = self.net(input_ids=ids, labels=ids, use_cache=False).loss
        self.steps.append({"step": int(self.global_step) + 1, "indices": [int(i) for i in batch["index"]],
                           "loss": float(loss.detach())})
        return loss

    def on_train_start(self) -> None:
        if self.pretrained is not None:  # run P: the LoRA weights training starts from, gathered
            import deepspeed

            lora = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters([p for _, p in lora]):
                values = {n: p.detach().clone() for n, p in lora}
            if self.global_rank == 0:
                torch.save(values, self.capture_end / "lora_start.pt")
        if self.capture is None:
            return
        import deepspeed
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

        frozen = [(n, p) for n, p in self.named_parameters() if not p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
            values = {n: p.detach().clone() for n, p in frozen}
        from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

        ids = {n: list(autoep_experts_for_rank(m.expert_placement_descriptor, m.ep_rank))
               for n, m in self.named_modules() if isinstance(m, AutoEPMoELayer)}
        self.capture.mkdir(parents=True, exist_ok=True)
        torch.save({"frozen": values, "local_experts": ids}, self.capture / f"frozen_rank{self.global_rank}.pt")

    def on_train_end(self) -> None:
        """Every parameter after the last step, gathered (all ranks take part), written by rank 0."""
        if self.capture_end is None:
            return
        import deepspeed

        params = list(self.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            values = {n: p.detach().clone() for n, p in params}
        if self.global_rank == 0:
            self.capture_end.mkdir(parents=True, exist_ok=True)
            torch.save(values, self.capture_end / "params_end.pt")

    def configure_model(self) -> None:
        """Run ``P``: the pretrained model loaded and wrapped here, under ``zero.Init``."""
        if self.net is None and self.pretrained is not None:
            self.net = pretrained_lora_model(self.pretrained)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        data = SyntheticLMData(num_samples=SAMPLES, seq_len=SEQ, vocab_size=VOCAB, seed=0)
        return DataLoader(data, batch_size=PER_RANK, shuffle=False, drop_last=True)


def _trainer(ep_size: int, max_steps: int, ckpt_dir: Path | None = None, every: int = 2,
             grouped: bool = False) -> L.Trainer:
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=every,
                                                     save_top_k=-1)] if ckpt_dir is not None else []
    strategy = ZeroMoEStrategy(ep_size=ep_size, grouped_experts=grouped, param_persistence_threshold=0,
                               timeout=timedelta(seconds=180))
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                     logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0)


def _run(name: str, out: Path, *, seed: int, ep_size: int, max_steps: int, resume: Path | None = None,
         save_every: int | None = None, logits: bool = False, grouped: bool = False, experts: bool = False,
         pretrained: Path | None = None) -> None:
    t0 = time.perf_counter()
    run_dir = out / name
    if pretrained is not None:
        module = LoraModule(None, capture_end=run_dir)
        module.pretrained = pretrained
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        module = LoraModule(lora_model(seed, experts), capture=run_dir if resume is not None else None,
                            capture_end=run_dir if experts and resume is None else None)
    trainable_before = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    trainer = _trainer(ep_size, max_steps, run_dir / "ckpt" if save_every else None, save_every or 2, grouped)
    trainer.fit(module, ckpt_path=resume)
    rank = trainer.global_rank
    run_dir.mkdir(parents=True, exist_ok=True)
    if logits:  # both ranks together: every forward gathers parameters and exchanges tokens
        engine = trainer.strategy.model
        engine.eval()
        ids = fixed_batch()
        with torch.no_grad():
            out_logits = engine(ids)
        torch.save({"input_ids": ids, "logits": out_logits.detach().float().clone()},
                   run_dir / f"engine_outputs_rank{rank}.pt")
    (run_dir / f"rank{rank}.json").write_text(json.dumps({
        "seed": seed, "ep_size": ep_size, "resumed_from": str(resume) if resume else None, "steps": module.steps,
        "trainable_before": trainable_before,
        "trainable_after": sorted(n for n, p in module.named_parameters() if p.requires_grad),
        "frozen_experts_written": str(getattr(trainer.strategy, "frozen_experts_written", None)),
        "seconds": round(time.perf_counter() - t0, 2)}))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="ABCDETUVP", help="which runs (for reproducing one by hand)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    out = args.out
    if "A" in args.only:
        _run("A", out, seed=0, ep_size=2, max_steps=6, save_every=2, logits=True)
    if "B" in args.only:
        _run("B", out, seed=1, ep_size=2, max_steps=4, resume=out / "A" / "ckpt" / "step=2.ckpt")
    if "C" in args.only:
        _run("C", out, seed=1, ep_size=1, max_steps=4, resume=out / "A" / "ckpt" / "step=2.ckpt", save_every=4)
    if "D" in args.only:
        _run("D", out, seed=1, ep_size=2, max_steps=6, resume=out / "C" / "ckpt" / "step=4.ckpt")
    if "E" in args.only:
        _run("E", out, seed=1, ep_size=1, grouped=True, max_steps=3, resume=out / "A" / "ckpt" / "step=2.ckpt",
             save_every=3)
    if "T" in args.only:
        _run("T", out, seed=0, ep_size=2, max_steps=4, save_every=2, logits=True, experts=True)
    if "U" in args.only:
        _run("U", out, seed=1, ep_size=2, max_steps=4, resume=out / "T" / "ckpt" / "step=2.ckpt", experts=True)
    if "V" in args.only:
        _run("V", out, seed=1, ep_size=1, max_steps=3, resume=out / "T" / "ckpt" / "step=2.ckpt", experts=True)
    if "P" in args.only:
        if dist.get_rank() == 0:
            L.seed_everything(0, verbose=False)
            build_hf_model("mixtral").save_pretrained(out / "P" / "pretrained")
        dist.barrier()
        _run("P", out, seed=0, ep_size=2, max_steps=2, save_every=2, logits=True, pretrained=out / "P" / "pretrained")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
