"""The DeepSpeed config the strategy builds, and how a user's config is merged over it (pure)."""

from __future__ import annotations

import pytest

from lightning_zeromoe.config.deepspeed import ZeroOptions, build_config, converts_blocks, merge_config


def test_stage3_defaults_follow_the_field_notes():
    config = build_config(ZeroOptions(ep_size=2), {"moe_layer_pattern": r"layers\.\d+\.mlp", "top_k": 2},
                          use_grouped_mm=False)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == 50_000_000
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 2, "use_grouped_mm": False,
                                         "moe_layer_pattern": r"layers\.\d+\.mlp", "top_k": 2}


def test_no_expert_parallel_section_without_blocks():
    assert "expert_parallel" not in build_config(ZeroOptions(), None, use_grouped_mm=True)


def test_user_config_wins_and_every_override_is_reported():
    base = build_config(ZeroOptions(), None, use_grouped_mm=True)
    merged, notes = merge_config(base, {"zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {"enabled": True}})
    assert merged["zero_optimization"]["stage"] == 2 and merged["bf16"] == {"enabled": True}
    assert notes == ["zero_optimization.stage: 3 -> 2 (from your config)"]  # equal values are not overrides
    assert base["zero_optimization"]["stage"] == 3, "the base config must not be modified"


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 4}, "is not a ZeRO stage"),
    ({"ep_size": 0}, "must be a positive integer"),
    ({"stage": 2, "offload_parameters": True}, "needs stage=3"),
    ({"reduce_bucket_size": 0}, "must be a positive number"),
    ({"grouped_experts": "yes"}, "must be True or False"),
])
def test_impossible_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroOptions(**kwargs)


def test_autoep_converts_with_expert_parallelism_or_grouped_experts():
    assert not converts_blocks(ZeroOptions(ep_size=1))
    assert converts_blocks(ZeroOptions(ep_size=2)) and converts_blocks(ZeroOptions(ep_size=1, grouped_experts=True))
    config = build_config(ZeroOptions(grouped_experts=True), {"moe_layer_pattern": "m"}, use_grouped_mm=True)
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 1, "use_grouped_mm": True,
                                         "moe_layer_pattern": "m"}
