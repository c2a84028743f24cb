"""A tiny LM around DeepSpeed's native ``deepspeed.moe.layer.MoE`` (the seeds' path at ZeRO stage 1/2).

Imported by ``strategy_paths.py`` for the 2-rank runs (``MoE(..., ep_size=2)``: each rank holds 2 of
the 4 experts), and by ``tests/test_strategy_paths.py`` for the reference: :class:`PlainMoELM`, the
same model in plain PyTorch (no DeepSpeed, no Lightning, no process group), all 4 experts local,
trained on the batches the ranks recorded.

Gating is top-1 with ``drop_tokens=False`` and ``use_rts=False``: no token is dropped and nothing
is random, so DeepSpeed's ``top1gating`` reduces to: softmax of the fp32 gate logits, the argmax
expert, output = its probability x that expert's output, and ``l_aux = E * sum_e mean_s(p_se) *
mean_s(1[e chosen for s])`` over one rank's tokens (deepspeed 0.19.8 ``moe/sharded_moe.py``).
:class:`PlainMoELM` writes that out. The aux loss is not linear in the batch, so the reference
averages the per-rank losses, which is exactly the loss whose gradient data-parallel training
averages.

Every weight is drawn from its own seeded generator, the experts' by their *global* index
(``ep_rank * num_local_experts + i``): the two runs start equal whatever order DeepSpeed builds
things in, and the experts differ from one another from step 0, so an expert on the wrong rank
or a token sent to the wrong expert shows in the first loss.
"""

from __future__ import annotations

import math
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeromoe.reference.models import SyntheticLMData

VOCAB, HIDDEN, EXPERTS, SEQ = 128, 32, 4, 17
AUX_WEIGHT, BATCH = 0.01, 4


def _seeded(tensor: torch.Tensor, seed: int, *, normal: bool = False) -> None:
    """Fill ``tensor`` from generator ``seed``: N(0, 1) (embedding init) or U(+-1/sqrt(fan_in)) (Linear's)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if normal:
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
        else:
            bound = 1.0 / math.sqrt(tensor.shape[-1] if tensor.dim() > 1 else HIDDEN)
            tensor.copy_((torch.rand(tensor.shape, generator=gen) * 2 - 1) * bound)


def expert_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


def init_shared(embed: nn.Embedding, gate_weight: torch.Tensor, head: nn.Linear) -> None:
    _seeded(embed.weight, 1, normal=True)
    _seeded(gate_weight, 2)
    _seeded(head.weight, 3)
    _seeded(head.bias, 4)


def init_expert(expert: nn.Sequential, global_index: int) -> None:
    for k, param in enumerate([expert[0].weight, expert[0].bias, expert[2].weight, expert[2].bias]):
        _seeded(param, 100 + 10 * global_index + k)


class NativeMoELM(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN, expert=expert_mlp(), num_experts=EXPERTS, ep_size=ep_size, k=1,
                       min_capacity=0, drop_tokens=False, use_rts=False)
        self.head = nn.Linear(HIDDEN, VOCAB)
        # DeepSpeed's expert groups are blocks of ep_size consecutive ranks: ep rank = rank % ep_size.
        ep_rank = int(os.environ.get("RANK", "0")) % ep_size
        inner = self.moe.deepspeed_moe
        init_shared(self.embed, inner.gate.wg.weight, self.head)
        local = inner.experts.deepspeed_experts
        for i, expert in enumerate(local):
            init_expert(expert, ep_rank * len(local) + i)

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


class PlainMoELM(nn.Module):
    """:class:`NativeMoELM` in plain PyTorch: every expert local, DeepSpeed's top-1 gating written out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(expert_mlp() for _ in range(EXPERTS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        init_shared(self.embed, self.gate.weight, self.head)
        for index, expert in enumerate(self.experts):
            init_expert(expert, index)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        x = h.reshape(-1, HIDDEN)
        probs = F.softmax(F.linear(x.float(), self.gate.weight.float()), dim=1)
        chosen = probs.argmax(dim=1)
        mask = F.one_hot(chosen, EXPERTS)
        l_aux = (probs.mean(dim=0) * mask.float().mean(dim=0)).sum() * EXPERTS
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        out = out * (probs * mask).sum(dim=1, keepdim=True)
        return self.head(h + out.reshape(h.shape)), l_aux


def plain_loss(model: PlainMoELM, input_ids: torch.Tensor) -> torch.Tensor:
    logits, l_aux = model(input_ids[:, :-1])
    task = F.cross_entropy(logits.flatten(0, 1).float(), input_ids[:, 1:].flatten())
    return task + AUX_WEIGHT * l_aux


def plain_reference(ranks: list[dict], steps: int, lr: float = 3e-3) -> list[float]:
    """The plain loop: each step the mean of the ranks' losses on the batches they recorded, AdamW."""
    model = PlainMoELM()
    data = SyntheticLMData(BATCH * len(ranks) * steps, SEQ, VOCAB, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for k in range(steps):
        loss = torch.stack([plain_loss(model, data.tokens[r["steps"][k]["indices"]]) for r in ranks]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
