"""Small LightningModules and nn.Modules that several test modules build.

``prepared`` attaches a strategy to a real Trainer and runs ``prepare()``, the very method
``setup_environment`` calls on every rank: validation runs as it does in a job, with no process group.
"""

from __future__ import annotations

import lightning as L
from torch import nn

from lightning_zeromoe import ZeroMoEStrategy


def prepared(module: L.LightningModule, devices: int = 2, num_nodes: int = 1, **kwargs) -> ZeroMoEStrategy:
    strategy = ZeroMoEStrategy(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)
    module.trainer = trainer
    strategy.connect(module)
    strategy.prepare()
    return strategy


class DenseModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.expert_mixer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)


class NativeMoEModule(L.LightningModule):
    """DeepSpeed's native ``deepspeed.moe.layer.MoE`` layer(s), built with the given ``ep_size``."""

    def __init__(self, ep_size: int = 1, second_ep_size: int | None = None) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, ep_size=ep_size, k=1)
        if second_ep_size is not None:
            self.moe2 = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, ep_size=second_ep_size, k=1)


class MovesItself(nn.Module):
    """A module that calls ``.to("cpu")`` on a child in forward: a no-op move on CPU."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        self.lin.to("cpu")
        return self.lin(x)
