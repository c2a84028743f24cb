"""The config is resolved once, from the merged config: the user's stage, autoep_size and enabled
are what is checked and used (pure functions, and the strategy in-process, no process group)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_zeromoe import ZeroMoEStrategy
from lightning_zeromoe.config.deepspeed import ZeroOptions
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
from lightning_zeromoe.config.resolve import (World, check_offload_optimizer, effective_ep_size, effective_grouped_experts,
                                       grouped_mm_applies, inference_config, resolve, zero_init_config)
from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.config.validation import ZeroMoEConfigError
from troubleshooter import knowledge

WORLD = World(world_size=4, devices_per_node=4, on_cpu=True)


@pytest.fixture(autouse=True)
def no_process_group_after():
    yield
    assert not torch.distributed.is_initialized()


def test_user_stage_is_the_stage_checked_and_used():
    """Native MoE + user stage 2: allowed (the constructor's default stage 3 is not what runs)."""
    from deepspeed.moe.layer import MoE

    module = nn.Module()
    module.moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)
    out = resolve(ZeroOptions(stage=3), WORLD, discover(module), user={"zero_optimization": {"stage": 2}})
    assert out.stage == 2 and out.config["zero_optimization"]["stage"] == 2
    assert "stage3_prefetch_bucket_size" not in out.config["zero_optimization"], "built for stage 2, not 3"
    with pytest.raises(ZeroMoEConfigError, match="native deepspeed.moe.layer.MoE"):
        resolve(ZeroOptions(stage=2), WORLD, discover(module), user={"zero_optimization": {"stage": 3}})


def test_user_autoep_size_is_validated_and_used():
    found = discover(TinyMoEModule(TinyMoEConfig(num_experts=4)))
    out = resolve(ZeroOptions(ep_size=2), WORLD, found, user={"expert_parallel": {"autoep_size": 4}})
    assert out.ep_size == 4 and out.config["expert_parallel"]["autoep_size"] == 4
    with pytest.raises(ZeroMoEConfigError, match="ep_size=4 does not divide num_experts=2"):
        resolve(ZeroOptions(ep_size=2), WORLD, discover(TinyMoEModule(TinyMoEConfig(num_experts=2))),
                user={"expert_parallel": {"autoep_size": 4}})
    # Only the config asks for EP: the blocks are still located for AutoEP.
    out = resolve(ZeroOptions(ep_size=1), WORLD, found, user={"expert_parallel": {"autoep_size": 2}})
    assert out.ep_size == 2 and out.config["expert_parallel"]["moe_layer_pattern"] == r"model\.layers\.\d+\.mlp"


def test_enabled_false_with_ep_size_is_refused_at_construction():
    with pytest.raises(ZeroMoEConfigError, match=r"^\[ep-disabled-by-config\] ZeroMoEStrategy\(ep_size=2\)"):
        ZeroMoEStrategy(ep_size=2, config={"expert_parallel": {"enabled": False}})
    assert effective_ep_size(1, {"expert_parallel": {"enabled": False}}) == 1


def test_launcher_check_uses_the_configs_autoep_size():
    with pytest.raises(ZeroMoEConfigError, match="ep_size=4 does not divide the world size 2"):
        L.Trainer(accelerator="cpu", devices=2, logger=False,
                  strategy=ZeroMoEStrategy(ep_size=2, config={"expert_parallel": {"autoep_size": 4}}))


def test_invalid_user_stage_is_refused():
    with pytest.raises(ZeroMoEConfigError, match=r"^\[merged-config-invalid\] zero_optimization.stage=5"):
        resolve(ZeroOptions(), WORLD, None, user={"zero_optimization": {"stage": 5}})


def test_user_stage_wins_over_auto_without_asking_the_planner():
    def planner(ep_size: int):
        raise AssertionError("the planner must not run when the config fixes the stage")

    out = resolve(ZeroOptions(), WORLD, None, auto_stage=True, choose_stage=planner,
                  user={"zero_optimization": {"stage": 2}})
    assert out.stage == 2 and any("stage='auto' not consulted" in n for n in out.notes)


def test_zero_init_config_is_stage_3_for_auto_and_the_users_stage_otherwise():
    assert zero_init_config(ZeroOptions(stage=3), auto_stage=True).stage == 3
    assert zero_init_config(ZeroOptions(stage=1), auto_stage=False).to_dict()["zero_optimization"]["stage"] == 1
    user = {"zero_optimization": {"stage": 2}}
    assert zero_init_config(ZeroOptions(stage=3), auto_stage=True, user=user).stage == 2


def test_grouped_mm_only_for_bf16_on_gpu():
    assert grouped_mm_applies(on_cpu=False, precision="bf16-mixed")
    assert grouped_mm_applies(on_cpu=False, precision="bf16-true")
    assert not grouped_mm_applies(on_cpu=False, precision="32-true")
    assert not grouped_mm_applies(on_cpu=False, precision="16-mixed")
    assert not grouped_mm_applies(on_cpu=True, precision="bf16-true")
    found = discover(TinyMoEModule())
    gpu = World(world_size=2, devices_per_node=2, on_cpu=False, precision="32-true")
    assert resolve(ZeroOptions(ep_size=2), gpu, found).config["expert_parallel"]["use_grouped_mm"] is False


def test_inference_config_keeps_expert_parallel_unless_already_converted():
    found = discover(TinyMoEModule())
    resolved = resolve(ZeroOptions(ep_size=2, offload_optimizer=True), World(2, 2, True), found,
                       user={"bf16": {"enabled": True}})
    config = resolved.config
    fresh = inference_config(resolved.ds_config, already_converted=False).to_dict()
    assert fresh["expert_parallel"] == config["expert_parallel"] and fresh["bf16"] == {"enabled": True}
    assert fresh["zero_optimization"]["stage"] == 3 and "offload_optimizer" not in fresh["zero_optimization"]
    assert fresh["zero_optimization"] == {k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"}
    assert list(fresh) == ["train_micro_batch_size_per_gpu", "bf16", "zero_allow_untested_optimizer",
                           "zero_optimization", "expert_parallel"] and fresh["train_micro_batch_size_per_gpu"] == 1
    assert "expert_parallel" not in inference_config(resolved.ds_config, already_converted=True).to_dict()


def test_offload_with_a_torch_optimizer_is_refused_naming_deepspeed_cpu_adam():
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ZeroMoEConfigError, match=r"^\[offload-needs-ds-cpu-optimizer\] .*torch.optim.adamw.AdamW.*DeepSpeedCPUAdam"):
        check_offload_optimizer(DeepSpeedConfig.from_dict(config), torch.optim.AdamW)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    check_offload_optimizer(DeepSpeedConfig.from_dict(config), DeepSpeedCPUAdam)  # the right optimizer passes
    for passes in ({"zero_optimization": {"stage": 3}},  # no offload: any optimizer
                   {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}},
                   {**config, "zero_force_ds_cpu_optimizer": False}):  # the user's call
        check_offload_optimizer(DeepSpeedConfig.from_dict(passes), torch.optim.AdamW)


# ------------------------------------------------------------------ grouped_experts (AutoEP's layer at ep_size=1)


def test_grouped_experts_gives_autoep_an_autoep_size_1_section():
    """ep_size=1 + grouped_experts: the blocks are located for AutoEP with autoep_size=1; the grouped
    GEMM is turned on where torch runs it (bf16 on CUDA) and the note says which expert path runs."""
    found = discover(TinyMoEModule())
    plain = resolve(ZeroOptions(ep_size=1), World(2, 2, True), found)
    assert "expert_parallel" not in plain.config and not plain.expert_parallel and not plain.grouped_experts
    cpu = resolve(ZeroOptions(ep_size=1, grouped_experts=True), World(2, 2, True), found)
    assert cpu.config["expert_parallel"] == {"enabled": True, "autoep_size": 1, "use_grouped_mm": False,
                                             **found.autoep}
    assert cpu.ep_size == 1 and cpu.grouped_experts and cpu.expert_parallel
    assert any("become AutoEP layers without expert parallelism" in n and "per-expert loop" in n for n in cpu.notes)
    gpu = resolve(ZeroOptions(ep_size=1, grouped_experts=True), World(1, 1, False, precision="bf16-true"), found)
    assert gpu.config["expert_parallel"]["use_grouped_mm"] is True and gpu.config["expert_parallel"]["autoep_size"] == 1
    assert any("torch._grouped_mm" in n for n in gpu.notes)
    # At ep_size > 1 the flag changes nothing: the blocks get AutoEP's layer anyway.
    ep2 = resolve(ZeroOptions(ep_size=2, grouped_experts=True), World(2, 2, True), found)
    without = resolve(ZeroOptions(ep_size=2), World(2, 2, True), found)
    assert ep2.config["expert_parallel"] == without.config["expert_parallel"]


def test_users_enabled_section_at_autoep_size_1_means_grouped_experts():
    """A config that enables AutoEP at autoep_size 1 by itself gets what grouped_experts gives (the blocks
    located), not a section AutoEP could not match against the LightningModule's names."""
    found = discover(TinyMoEModule())
    for user in ({"expert_parallel": {"enabled": True}}, {"expert_parallel": {"enabled": True, "autoep_size": 1}}):
        out = resolve(ZeroOptions(ep_size=1), World(2, 2, True), found, user=user)
        assert out.grouped_experts and out.config["expert_parallel"]["moe_layer_pattern"] == r"model\.layers\.\d+\.mlp"
        assert any("expert_parallel.enabled: true at autoep_size 1 in your config" in n for n in out.notes)
    assert not effective_grouped_experts(False, 2, {"expert_parallel": {"enabled": True}})  # that is EP


@pytest.mark.parametrize("config, entry, words", [
    ({"expert_parallel": {"enabled": False}}, "ep-disabled-by-config",
     r"^\[ep-disabled-by-config\] ZeroMoEStrategy\(ep_size=1, grouped_experts=True\) asks for AutoEP's grouped-"
     r"experts layer, but your DeepSpeed config sets expert_parallel.enabled: false"),
    ({"expert_parallel": {"use_grouped_mm": False}}, "merged-config-invalid",
     r"^\[merged-config-invalid\] expert_parallel.use_grouped_mm=false in your config contradicts "
     r"ZeroMoEStrategy\(grouped_experts=True\)"),
])
def test_contradictory_grouped_experts_config_is_refused_at_construction(config, entry, words):
    with pytest.raises(ZeroMoEConfigError, match=words) as err:
        ZeroMoEStrategy(grouped_experts=True, config=config)
    assert err.value.entry_id == entry and knowledge.match(str(err.value))[0].entry.id == entry
    ZeroMoEStrategy(grouped_experts=False, config=config)  # without the flag, the same config is fine


def test_grouped_experts_without_moe_blocks_is_refused_at_setup():
    from support.modules import DenseModule, prepared

    with pytest.raises(ZeroMoEConfigError, match=r"^\[autoep-no-moe-layers\] grouped_experts=True but no MoE block"
                                                 r".*or use ep_size=1 and grouped_experts=False"):
        prepared(DenseModule(), ep_size=1, grouped_experts=True)
    strategy = prepared(TinyMoEModule(), ep_size=1, grouped_experts=True)
    assert strategy.config["expert_parallel"]["autoep_size"] == 1 and strategy.resolved.grouped_experts


def test_stage_auto_plans_for_the_ep_size_that_runs():
    """``stage="auto"`` asks the planner about the config's ``autoep_size``, not the ``ep_size=`` keyword."""
    asked = []

    def planner(ep_size: int) -> tuple[int, str]:
        asked.append(ep_size)
        return 2, "fits"

    out = resolve(ZeroOptions(ep_size=1), WORLD, discover(TinyMoEModule(TinyMoEConfig(num_experts=4))),
                  auto_stage=True, choose_stage=planner, user={"expert_parallel": {"autoep_size": 2}})
    assert asked == [2] and out.stage == 2 and out.ep_size == 2
