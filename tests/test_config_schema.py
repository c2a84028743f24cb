"""The typed DeepSpeed config (``lightning_zeromoe.config.schema``): exact round trips of every config
the strategy builds, typed reads per section, unknown keys kept verbatim, and ``[merged-config-invalid]``
for a value of the wrong type. Pure: no process group, no engine."""

from __future__ import annotations

import json

import pytest

from lightning_zeromoe.config.deepspeed import ZeroOptions
from lightning_zeromoe.config.keywords import split_keywords
from lightning_zeromoe.config.resolve import World, inference_config, resolve, zero_init_config
from lightning_zeromoe.config.schema import BatchSection, DeepSpeedConfig, ExpertParallelSection
from lightning_zeromoe.config.validation import ZeroMoEConfigError
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
from troubleshooter import knowledge

#: A user config with keys the schema does not type, at the top and inside each section.
USER = {
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "zero_optimization": {"stage": 2, "round_robin_gradients": True, "offload_optimizer": {"device": "cpu",
                                                                                           "ratio": 0.5}},
    "expert_parallel": {"autoep_size": 2, "route_scale": 2.0, "expert_w3": None, "comm_backend": "torch"},
    "bf16": {"enabled": True, "immediate_grad_update": False},
    "train_micro_batch_size_per_gpu": 2, "train_batch_size": 16, "gradient_clipping": 1.0,
    "wall_clock_breakdown": False, "steps_per_print": None,
}

KEYWORDS = {"partition_activations": True, "sub_group_size": 1000, "block_size": 4096,
            "logging_batch_size_per_gpu": 3, "offload_optimizer_device": "cpu", "nvme_path": "/tmp/nvme"}


def _configs() -> list[dict]:
    """What ``resolve`` / ``zero_init_config`` / ``inference_config`` build over the inputs the config
    tests use: each stage, offload, EP sizes, grouped experts, Lightning keywords, user configs."""
    found = discover(TinyMoEModule(TinyMoEConfig(num_experts=4)))
    out = []
    for stage in (0, 1, 2, 3):
        for ep in (1, 2):
            out.append(resolve(ZeroOptions(stage=stage, ep_size=ep), World(2, 2, True), found).config)
    sections = split_keywords(KEYWORDS, offload_optimizer=True, offload_parameters=True).config_sections(
        offload_optimizer=True, offload_parameters=True)
    cases = [
        (ZeroOptions(ep_size=2, offload_optimizer=True, offload_parameters=True, pin_memory=True), None, sections),
        (ZeroOptions(ep_size=1, grouped_experts=True), {"expert_parallel": {"enabled": True}}, None),
        (ZeroOptions(ep_size=1), USER, None),
        (ZeroOptions(ep_size=2), {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 0}}, None),
        (ZeroOptions(ep_size=2), {"gradient_accumulation_steps": 2}, None),
    ]
    for options, user, keyword_sections in cases:
        world = World(4, 4, False, precision="bf16-true", accumulate_grad_batches=2)
        resolved = resolve(options, world, found, user=user, keyword_sections=keyword_sections)
        out.append(resolved.config)
        out.append(inference_config(resolved.ds_config, already_converted=False).to_dict())
        out.append(zero_init_config(options, auto_stage=True, user=user, keyword_sections=keyword_sections).to_dict())
    return out


def test_every_built_config_round_trips_exactly_in_order():
    configs = _configs()
    assert len({json.dumps(c, sort_keys=True) for c in configs}) > 10  # the inputs build different configs
    for config in configs:
        again = DeepSpeedConfig.from_dict(config).to_dict()
        assert again == config and json.dumps(again) == json.dumps(config)  # values and key order


def test_a_user_config_keeps_every_key_verbatim():
    config = DeepSpeedConfig.from_dict(USER)
    assert json.dumps(config.to_dict()) == json.dumps(USER)
    assert config.extra["optimizer"] == USER["optimizer"] and config.extra["steps_per_print"] is None
    assert dict(config.zero.extra) == {"round_robin_gradients": True}
    assert dict(config.zero.offload_optimizer.extra) == {"ratio": 0.5}
    assert dict(config.expert_parallel.extra) == {"route_scale": 2.0, "expert_w3": None, "comm_backend": "torch"}
    assert dict(config.precision.bf16.extra) == {"immediate_grad_update": False}
    # what to_dict hands out is a copy: changing it changes nothing in the tree
    out = config.to_dict()
    out["optimizer"]["params"]["lr"] = 1.0
    out["zero_optimization"]["offload_optimizer"]["ratio"] = 0.0
    assert config.to_dict() == USER


def test_each_section_reads_typed():
    config = DeepSpeedConfig.from_dict(USER)
    assert config.stage == 2 and config.zero.stage == 2
    assert config.offload_optimizer.device == "cpu" and config.offload_optimizer.active
    assert config.zero.offload_param is None
    assert config.expert_parallel.autoep_size == 2 and config.expert_parallel.enabled is None
    assert not config.converts_blocks and config.autoep_size == 1  # AutoEP is off unless enabled: true
    assert config.precision.bf16.enabled is True and config.precision.fp16 is None
    assert config.batch == BatchSection(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_clipping=1.0)
    assert config.force_ds_cpu_optimizer
    enabled = DeepSpeedConfig.from_dict({"expert_parallel": {"enabled": True, "autoep_size": 4}})
    assert enabled.converts_blocks and enabled.autoep_size == 4 and enabled.stage == 0  # DeepSpeed's default stage
    assert DeepSpeedConfig.from_dict({"train_batch_size": "auto"}).batch.train_batch_size == "auto"
    assert not DeepSpeedConfig.from_dict({"zero_force_ds_cpu_optimizer": False}).force_ds_cpu_optimizer


def test_changed_fields_serialise_in_place_and_dropped_sections_vanish():
    config = DeepSpeedConfig.from_dict({"a": 1, "expert_parallel": {"enabled": True, "moe_layer_pattern": None,
                                                                    "x": 2}, "b": 3})
    section = config.expert_parallel.__class__(**{**config.expert_parallel.__dict__, "moe_layer_pattern": "p"})
    out = config.replace(expert_parallel=section).to_dict()
    assert list(out) == ["a", "expert_parallel", "b"]
    assert list(out["expert_parallel"].items()) == [("enabled", True), ("moe_layer_pattern", "p"), ("x", 2)]
    assert config.replace(expert_parallel=None).to_dict() == {"a": 1, "b": 3}
    added = DeepSpeedConfig(expert_parallel=ExpertParallelSection(enabled=True, autoep_size=2)).to_dict()
    assert added == {"expert_parallel": {"enabled": True, "autoep_size": 2}}


@pytest.mark.parametrize("config, words", [
    ({"bf16": True}, "bf16=True in your config must be a JSON object"),
    ({"zero_optimization": 3}, "zero_optimization=3 in your config must be a JSON object"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage='3' in your config is not a ZeRO stage"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": 1}}},
     "zero_optimization.offload_param.device=1 in your config must be a string"),
    ({"expert_parallel": {"enabled": "yes"}}, "expert_parallel.enabled='yes' in your config must be true or false"),
    ({"expert_parallel": {"autoep_size": 0}}, "expert_parallel.autoep_size=0 in your config must be a positive"),
    ({"train_micro_batch_size_per_gpu": "four"}, "train_micro_batch_size_per_gpu='four' in your config must be an "
                                                 "integer or 'auto'"),
    ({"gradient_clipping": True}, "gradient_clipping=True in your config must be a number"),
])
def test_a_wrong_type_is_refused_naming_the_key(config, words):
    with pytest.raises(ZeroMoEConfigError, match=r"^\[merged-config-invalid\] " + words) as err:
        DeepSpeedConfig.from_dict(config)
    assert err.value.entry_id == "merged-config-invalid"
    assert knowledge.match(str(err.value))[0].entry.id == "merged-config-invalid"


def test_resolve_refuses_a_wrong_type_in_the_users_config():
    with pytest.raises(ZeroMoEConfigError, match=r"^\[merged-config-invalid\] fp16=1 in your config"):
        resolve(ZeroOptions(), World(2, 2, True), None, user={"fp16": 1})
