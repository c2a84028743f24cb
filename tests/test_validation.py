"""Each bad setting is refused (or warned about) before any process group or engine exists.

These run in pytest's own process: the strategy is attached to a real Trainer and LightningModule,
and ``prepare()`` is the very method ``setup_environment`` calls on every rank.
"""

from __future__ import annotations


import lightning as L
import pytest
import torch

from lightning_zeromoe import MoEPattern, ZeroMoEStrategy
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
from lightning_zeromoe.config.validation import Layout, ZeroMoEConfigError, check_layout
from support.modules import DenseModule, NativeMoEModule, prepared


@pytest.fixture(autouse=True)
def no_process_group_after():
    yield
    assert not torch.distributed.is_initialized(), "validation must not create a process group"


def test_ep_size_must_divide_world_size_refused_at_trainer_construction():
    with pytest.raises(ZeroMoEConfigError, match=r"ep_size=3 does not divide the world size 2.*\[1, 2\]"):
        L.Trainer(accelerator="cpu", devices=2, strategy=ZeroMoEStrategy(ep_size=3), logger=False)


def test_ep_size_must_divide_expert_count():
    with pytest.raises(ZeroMoEConfigError, match=r"ep_size=2 does not divide num_experts=3 in 'model.layers.0.mlp'.*\[1, 3\]"):
        prepared(TinyMoEModule(TinyMoEConfig(num_experts=3)), ep_size=2)


def test_top_k_larger_than_expert_count():
    pattern = MoEPattern(block=r"model\.layers\.\d+\.mlp", top_k=8)
    with pytest.raises(ZeroMoEConfigError, match=r"top_k=8 exceeds num_experts=4"):
        prepared(TinyMoEModule(), ep_size=2, moe_pattern=pattern)


def test_ep_size_beyond_one_node_warns():
    with pytest.warns(UserWarning, match=r"ep_size=4 is larger than the 2 devices per node"):
        prepared(TinyMoEModule(), devices=2, num_nodes=2, ep_size=4)


def test_no_moe_blocks_with_ep_lists_candidates():
    with pytest.raises(ZeroMoEConfigError, match=r"(?s)ep_size=2 but no MoE block was found.*MoEPattern.*expert_mixer \(Linear\)"):
        prepared(DenseModule(), ep_size=2)


def test_native_deepspeed_moe_under_stage3_names_both_ways_out():
    with pytest.raises(ZeroMoEConfigError, match=r"(?s)native deepspeed.moe.layer.MoE.*AutoEP.*stage=2"):
        prepared(NativeMoEModule(), ep_size=1)


def test_native_moe_is_allowed_under_stage2():
    strategy = prepared(NativeMoEModule(), ep_size=1, stage=2)
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert "expert_parallel" not in strategy.config


@pytest.mark.parametrize("stage", [1, 2])
def test_native_moe_ep_size_matching_the_modules_writes_no_autoep_section(stage):
    """ep_size=2 with MoE(ep_size=2) layers: accepted, and the expert groups are left to the layers."""
    strategy = prepared(NativeMoEModule(ep_size=2), ep_size=2, stage=stage)
    assert strategy.resolved.ep_size == 2 and not strategy.resolved.expert_parallel
    assert "expert_parallel" not in strategy.config
    assert not any("ep_size=2, from the model" in n for n in strategy.resolved.notes)  # asked for, not taken


def test_native_moe_ep_size_left_unset_takes_the_modules_and_says_so():
    strategy = prepared(NativeMoEModule(ep_size=2), stage=2)
    assert strategy.resolved.ep_size == 2 and "expert_parallel" not in strategy.config
    [note] = [n for n in strategy.resolved.notes if "native deepspeed.moe.layer.MoE" in n]
    assert note.startswith("ZeroMoEStrategy: ep_size=2, from the model's 1 native deepspeed.moe.layer.MoE module(s) ('moe')")


@pytest.mark.parametrize("module, kwargs, message", [
    (lambda: NativeMoEModule(ep_size=2), {"ep_size": 1},
     r"^\[native-moe-ep-size\] ZeroMoEStrategy\(ep_size=1\), but the model's 1 native deepspeed.moe.layer.MoE "
     r"module\(s\) \('moe'\) were built with ep_size=2, .*Pass the layers' own size, "
     r"ZeroMoEStrategy\(ep_size=2\), or leave ep_size unset"),
    (lambda: NativeMoEModule(ep_size=1), {"ep_size": 2},
     r"^\[native-moe-ep-size\] ZeroMoEStrategy\(ep_size=2\), but .* built with ep_size=1"),
    (lambda: NativeMoEModule(ep_size=1, second_ep_size=2), {},
     r"^\[native-moe-ep-size\] .*different ep_size values \(ep_size=1: 'moe'; ep_size=2: 'moe2'\).*MoE\(\.\.\., ep_size=N\)"),
    (lambda: NativeMoEModule(ep_size=4), {},
     r"^\[ep-size-divisibility\] the model's native .* built with ep_size=4, which does not divide the world size 2 .*\[1, 2\]"),
    (lambda: NativeMoEModule(ep_size=2), {"config": {"expert_parallel": {"enabled": True, "autoep_size": 2}}},
     r"^\[native-moe-ep-size\] your DeepSpeed config has an expert_parallel \(AutoEP\) section"),
])
def test_native_moe_ep_size_mismatch_is_refused_at_connect_before_any_process_group(module, kwargs, message):
    """Refused in ``connect`` (each rank, before ``setup_environment`` creates the process group),
    and the same in ``prepare`` (``setup``) for layers built in ``configure_model``."""
    strategy = ZeroMoEStrategy(stage=2, **kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    model = module()
    model.trainer = trainer
    with pytest.raises(ZeroMoEConfigError, match=message) as err:
        strategy.connect(model)
    assert "\n" not in str(err.value)
    strategy._lightning_module = model  # as if the layers had been built in configure_model
    with pytest.raises(ZeroMoEConfigError, match=message):
        strategy.prepare()


def test_native_moe_under_stage3_is_refused_as_before_whatever_the_ep_size():
    with pytest.raises(ZeroMoEConfigError, match=r"^\[native-moe-zero3\]"):
        prepared(NativeMoEModule(ep_size=2), ep_size=1)


def test_batch_arithmetic_mismatch():
    config = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ZeroMoEConfigError, match=r"train_batch_size=10 but .* 4 x 1 x 2 = 8"):
        prepared(TinyMoEModule(), ep_size=2, config=config)


def test_batch_arithmetic_consistent_passes_and_user_config_wins(caplog):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"reduce_bucket_size": 1000}}
    strategy = prepared(TinyMoEModule(), ep_size=2, config=config)
    assert strategy.config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.config["expert_parallel"]["autoep_size"] == 2


def test_fp16_with_moe_warns_bf16():
    found = discover(TinyMoEModule())
    warnings_ = check_layout(Layout(world_size=2, devices_per_node=2, ep_size=2, stage=3, precision="16-mixed"), found)
    assert any("bf16" in w for w in warnings_)
    assert not check_layout(Layout(world_size=2, devices_per_node=2, ep_size=2, stage=3, precision="bf16-mixed"), found)


def test_config_file_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="DeepSpeed config file not found"):
        ZeroMoEStrategy(config=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ValueError, match=r"bad.json:1:\d+: invalid JSON"):
        ZeroMoEStrategy(config=bad)


@pytest.mark.parametrize("imports", [
    "from lightning_zeromoe import ZeroMoEStrategy",
    "import lightning_zeromoe; import lightning",
    "import lightning; import lightning_zeromoe",
])
def test_strategy_registered_by_name_in_any_import_order(imports):
    """``Trainer(strategy="zero_moe")`` after importing our package, before or after Lightning."""
    import subprocess
    import sys

    code = (f"{imports}\nimport lightning as L\n"
            "t = L.Trainer(strategy='zero_moe', accelerator='cpu', devices=1, logger=False)\n"
            "print(type(t.strategy).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "ZeroMoEStrategy"


def test_self_described_tiny_model_pattern_is_rooted_at_the_lightning_module():
    found = discover(TinyMoEModule())
    assert found.source == "self-described"
    assert [b.path for b in found.blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert found.autoep["moe_layer_pattern"] == r"model\.layers\.\d+\.mlp"
    assert found.autoep["top_k"] == 2


def test_stage_auto_picks_the_lowest_stage_that_fits(caplog):
    """The tiny model fits anywhere: the planner picks stage 1 (not ZeRO-3) and says why."""
    import logging

    with caplog.at_level(logging.INFO):
        strategy = prepared(TinyMoEModule(), ep_size=2, stage="auto")
    assert strategy.config["zero_optimization"]["stage"] == 1
    assert "stage='auto'" in caplog.text and "planner" in caplog.text


def test_stage_must_be_a_number_or_auto():
    with pytest.raises(ValueError, match="use 0, 1, 2, 3 or 'auto'"):
        ZeroMoEStrategy(stage="three")
