"""Native ``deepspeed.moe.layer.MoE`` layers under ``stage="auto"``, and beside AutoEP blocks.

``stage="auto"`` plans with the layers' own ``ep_size`` and their per-rank share of the experts,
and never answers stage 3, which DeepSpeed refuses for native layers: when only stage 3 (or
offload) fits, the run is refused before any process group. A model that holds native layers and
blocks AutoEP would convert is refused (the blocks would train unconverted). No process group:
the real strategy's ``prepare()`` (tests/support/modules.py) and the real memory planner.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_zeromoe.config.deepspeed import ZeroOptions
from lightning_zeromoe.config.native_moe import native_plan_counts
from lightning_zeromoe.config.resolve import World, resolve
from lightning_zeromoe.config.validation import ZeroMoEConfigError
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.planner import count_params, plan
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM
from support.modules import NativeMoEModule, prepared
from troubleshooter import knowledge


@pytest.fixture(autouse=True)
def no_process_group_after():
    yield
    assert not torch.distributed.is_initialized()


def test_native_plan_counts_are_the_whole_layers():
    """A layer built with ep_size=2 holds 2 of its 4 experts; the planner's counts hold all 4, as
    the same layer built with ep_size=1 does (the planner then splits them by ep_size)."""
    local, whole = NativeMoEModule(ep_size=2), NativeMoEModule(ep_size=1)
    counts = native_plan_counts(local, 2)
    assert count_params(local).expert_total * 2 == counts.expert_total == count_params(whole).expert_total
    assert counts.dense == count_params(whole).dense and counts.expert_total > 0


def test_stage_auto_with_native_layers_plans_with_their_ep_size():
    asked = []

    def planner(ep_size: int, **how: bool) -> tuple[int, str]:
        asked.append((ep_size, how))
        return 2, "fits"

    found = discover(NativeMoEModule(ep_size=2))
    out = resolve(ZeroOptions(), World(world_size=2, devices_per_node=2, on_cpu=True), found, auto_stage=True,
                  choose_stage=planner, ep_size_given=False)
    assert asked == [(2, {"native": True})] and out.stage == 2 and out.ep_size == 2
    assert "expert_parallel" not in out.config


def test_stage_auto_never_picks_stage_3_for_native_layers(monkeypatch):
    """With plenty of memory the real planner answers stage 1; with memory between what stage 2 and
    stage 3 need, it would answer 3, which native layers cannot run: refused, naming the entry."""
    strategy = prepared(NativeMoEModule(ep_size=2), stage="auto")
    assert strategy.resolved.stage == 1 and strategy.resolved.ep_size == 2
    assert any(n.startswith("ZeroMoEStrategy(stage='auto'): stage=1") for n in strategy.resolved.notes)

    module = NativeMoEModule(ep_size=2)
    p = plan(module, counts=native_plan_counts(module, 2), num_gpus=2, gpus_per_node=2, ep_size=2,
             gpu_memory_bytes=1.0, precision="32-true")
    need = {s.stage: p.device_bytes(s) for s in p.estimates if not s.offload_optimizer}
    assert need[3] < need[2] < need[1]
    between = (need[2] + need[3]) / 2 / (1 - p.headroom)
    monkeypatch.setattr("lightning_zeromoe.strategy.device_memory_bytes", lambda *args: between)
    with pytest.raises(ZeroMoEConfigError) as err:
        prepared(module, stage="auto")
    text = str(err.value)
    assert knowledge.entry_of(text) == "native-moe-zero3" and knowledge.match(text)[0].entry.id == "native-moe-zero3"
    assert "cannot run under ZeRO stage 3" in text and "ep_size=2" in text and "stage=2 yourself" in text


class Mixed(L.LightningModule):
    """A native MoE layer beside a hand-written MoE model whose blocks AutoEP converts."""

    def __init__(self, native_ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.native = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=native_ep_size, k=1)
        self.model = TinyMoELM(TinyMoEConfig(num_experts=4))


def test_native_layers_beside_autoep_blocks_are_refused():
    found = discover(Mixed(2))
    assert found.native_moe == ["native"] and found.blocks  # discovery sees both kinds
    with pytest.raises(ZeroMoEConfigError) as err:
        prepared(Mixed(2), stage=2)
    text = str(err.value)
    assert knowledge.entry_of(text) == "native-moe-mixed-blocks"
    assert "('native', ep_size=2)" in text and f"'{found.blocks[0].path}'" in text and "unconverted" in text


def test_native_layers_without_expert_parallelism_beside_blocks_train_as_built():
    """ep_size=1 everywhere: nothing is expert-parallel, so nothing is silently left out; allowed."""
    strategy = prepared(Mixed(1), stage=2)
    assert strategy.resolved.ep_size == 1 and "expert_parallel" not in strategy.config
