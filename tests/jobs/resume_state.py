"""Resume on another shape keeps the *whole* model state: buffers, and parameters frozen only now.

Launched with ``torchrun --nproc_per_node 2``. For each ``SRC:DST`` pair of ``ep_size`` values it
trains a tiny DeepSeek-V3 (``tests/support/hf_zoo.py``: non-zero ``e_score_correction_bias`` routing
buffers, as a pretrained model has) for two steps under ``ZeroMoEStrategy(ep_size=SRC)`` and saves
it. The LightningModule also keeps a persistent buffer of its own (``tokens_seen``, counted in
``training_step``) and a non-persistent one. Rank 0 then exports the checkpoint with
``zeromoe-export``'s function: that file is the reference for every tensor of the network, under
the model's own names.

A new job resumes the checkpoint with ``ep_size=DST`` on a model built with *other* initial values
(seed 1: other weights, other routing biases, ``tokens_seen`` zero) whose embedding is now frozen
(trained when saved, frozen now). Right after the checkpoint is loaded (``on_train_start``), each
rank gathers every buffer and every frozen parameter of the engine's module and writes them to
``<out>/<SRC>to<DST>/rank<r>.pt``; ``tests/test_resume_state.py`` compares them with the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
for extra in (REPO, REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from support.hf_zoo import VOCAB, build  # noqa: E402
from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData  # noqa: E402

ARCH = "deepseek_v3"
FROZEN_NOW = os.environ.get("RESUME_STATE_FROZEN", "net.model.embed_tokens.weight")
STEPS = 2


class StateModule(L.LightningModule):
    """An HF causal LM with a buffer of the LightningModule's own beside it."""

    def __init__(self, net: torch.nn.Module, frozen: tuple[str, ...] = (), capture: Path | None = None) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.full((3,), 7.0), persistent=False)
        for name in frozen:
            self.get_parameter(name).requires_grad_(False)
        self.capture = capture

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.tokens_seen += batch["input_ids"].numel()
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

    def on_train_start(self) -> None:
        if self.capture is None:
            return
        import deepspeed

        frozen = [(n, p) for n, p in self.named_parameters() if not p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
            state = {"frozen": {n: p.detach().clone() for n, p in frozen},
                     "buffers": {n: b.detach().clone() for n, b in self.named_buffers()},
                     "persistent": sorted(n for n, _ in self.state_dict(keep_vars=True).items()
                                          if n in dict(self.named_buffers()))}
        self.capture.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.capture / f"rank{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        data = SyntheticLMData(num_samples=16, seq_len=9, vocab_size=VOCAB, seed=0)
        return DataLoader(data, batch_size=2, shuffle=False, drop_last=True)


def _trainer(ep: str, max_steps: int, stage: int) -> L.Trainer:
    """``ep``: an ep_size, or ``cN`` for ``ep_size=1`` with ``expert_parallel.autoep_size: N`` in the
    config (the config wins: the engine runs with N)."""
    config = {"expert_parallel": {"autoep_size": int(ep[1:])}} if ep.startswith("c") else None
    strategy = ZeroMoEStrategy(ep_size=1 if config else int(ep), stage=stage, config=config,
                               param_persistence_threshold=0, timeout=timedelta(seconds=120))
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)


def run_pair(src: str, dst: str, stage: int, out: Path) -> None:
    from lightning_zeromoe.checkpoint import export

    case = out / f"{src}to{dst}" if stage == 3 else out / f"{src}to{dst}_stage{stage}"
    ckpt = case / "checkpoint"
    source = StateModule(build(ARCH, seed=0))
    _trainer(src, STEPS, stage).fit(source)
    trainer = source.trainer
    trainer.save_checkpoint(ckpt)
    if dist.get_rank() == 0:
        export(ckpt, case / "reference.safetensors", progress=False)
        (case / "source.json").write_text(json.dumps({"tokens_seen": int(source.tokens_seen)}))
    dist.barrier()
    resumed = StateModule(build(ARCH, seed=1), frozen=tuple(n for n in (FROZEN_NOW,) if n), capture=case / "resumed")
    _trainer(dst, STEPS + 1, stage).fit(resumed, ckpt_path=ckpt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", nargs="+", default=["2:1", "1:2", "c2:c2"],
                        help="SRC:DST[:STAGE]: ep_size (or cN, see _trainer) saved and resumed; ZeRO stage 3 by default")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    for pair in args.pairs:
        src, dst, *stage = pair.split(":")
        run_pair(src, dst, int(stage[0]) if stage else 3, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
