"""A tiny LM around DeepSpeed's native ``deepspeed.moe.layer.MoE`` (the seeds' path at ZeRO stage 1/2).

Imported by ``strategy_paths.py`` for the 2-rank runs; run as a script it is the plain
single-process reference: the same model with ``ep_size=1`` (all experts local) in a 1-rank gloo
group, no engine, no Lightning, trained on the batches the ranks recorded::

    python tests/jobs/native_moe.py --reference DIR/native_s1 DIR/native_s2 --steps 6

Gating is top-1 with ``drop_tokens=False`` and ``use_rts=False``: no token is dropped and nothing
is random, so a rank's forward pass equals the reference's on that rank's half of the batch. The
aux loss ``l_aux`` is not linear in the batch, so the reference averages the per-rank losses, which
is exactly the loss whose gradient data-parallel training averages.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeromoe.reference.models import SyntheticLMData

VOCAB, HIDDEN, EXPERTS, SEQ = 128, 32, 4, 17
AUX_WEIGHT, BATCH = 0.01, 4


class NativeMoELM(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.embed = nn.Embedding(VOCAB, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(hidden_size=HIDDEN, expert=expert, num_experts=EXPERTS, ep_size=ep_size, k=1,
                       min_capacity=0, drop_tokens=False, use_rts=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        out, l_aux, _ = self.moe(h)
        return self.head(h + out), l_aux


def native_loss(model: NativeMoELM, input_ids: torch.Tensor) -> torch.Tensor:
    logits, l_aux = model(input_ids[:, :-1])
    task = F.cross_entropy(logits.flatten(0, 1).float(), input_ids[:, 1:].flatten())
    return task + AUX_WEIGHT * l_aux


class NativeMoEModule(L.LightningModule):
    def __init__(self, ep_size: int, batch_size: int = BATCH, num_samples: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = NativeMoELM(ep_size)
        self.batch_size, self.num_samples, self.lr = batch_size, num_samples, lr
        self._last = torch.zeros(())

    @property
    def last_losses(self) -> dict[str, float]:
        return {"loss": float(self._last)}

    def training_step(self, batch, batch_idx):
        loss = native_loss(self.model, batch["input_ids"])
        self._last = loss.detach()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    def train_dataloader(self):
        data = SyntheticLMData(self.num_samples, SEQ, VOCAB, seed=0)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)


def reference(run_dir: Path, steps: int, lr: float) -> list[float]:
    """Plain loop: same seed, ep_size=1, each step the mean of the two ranks' losses on their batches."""
    import os
    import socket

    import deepspeed

    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      DS_ACCELERATOR="cpu")
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed("gloo")  # the MoE layer's groups live in deepspeed.comm
    L.seed_everything(0, verbose=False)
    model = NativeMoELM(ep_size=1)
    model.moe.set_deepspeed_parallelism()
    data = SyntheticLMData(BATCH * 2 * steps, SEQ, VOCAB, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for k in range(steps):
        halves = [native_loss(model, data.tokens[r["steps"][k]["indices"]]) for r in ranks]
        loss = torch.stack(halves).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", type=Path, required=True, nargs="+", help="run directories")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    print(json.dumps({str(d): reference(d, args.steps, args.lr) for d in args.reference}))
