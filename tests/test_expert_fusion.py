"""``lightning_zeromoe.loading.expert_fusion``: per-expert fusion equals transformers' whole-layer conversion.

No processes: a ZeRO-3 partition is stood in for by a parameter carrying DeepSpeed's attributes
(``ds_shape``, ``ds_numel``, ``ds_tensor``, ``ds_status``) with rank 0's share, as DeepSpeed lays it out.
The 2-rank path through real ``zero.Init`` partitions is tests/test_pretrained.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zeromoe.loading import expert_fusion
from lightning_zeromoe.loading.hf_zero3 import layer_groups
from support import hf_zoo  # tests/ is on sys.path (conftest)

# Families whose checkpoints hold one tensor per expert (transformers' conversion fuses them) plus one
# (granitemoe) whose conversion is not row-separable and must stay whole.
FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "granitemoe")


def _fake_partition(param: torch.Tensor, world: int) -> torch.Tensor:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    fake = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    fake.ds_shape, fake.ds_numel = tuple(param.shape), param.numel()
    fake.ds_tensor = torch.full((math.ceil(param.numel() / world),), float("nan"))
    fake.ds_tensor.ds_numel = fake.ds_tensor.numel()
    fake.ds_status = ZeroParamStatus.NOT_AVAILABLE
    return fake


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_per_expert_rows_equal_the_whole_conversion(tmp_path, model_type, world):
    """Rank 0's partition filled expert by expert equals its slice of transformers' fused tensor; only
    the experts overlapping it are converted (with 3 ranks a partition ends inside an expert's row)."""
    from safetensors.torch import load_file
    from transformers.conversion_mapping import get_model_conversion_mapping

    from lightning_zeromoe._private.transformers import apply_weight_conversions

    model = hf_zoo.build(model_type)
    model.save_pretrained(tmp_path)
    saved = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        saved.update(load_file(file))
    mapping = get_model_conversion_mapping(model)
    whole = apply_weight_conversions(model, dict(saved), mapping)  # transformers' own, as one dict
    params = {name: _fake_partition(p, world) for name, p in model.named_parameters(remove_duplicate=False)}

    fused = 0
    for keys in layer_groups(saved.keys()):
        rest, items = expert_fusion.split_expert_rows(keys, mapping, params, model.base_model_prefix)
        assert sorted(rest + [k for item in items for k in item.keys]) == sorted(keys), "a key was lost or doubled"
        for item in items:
            calls = []

            def convert(part, item=item):
                calls.append(1)
                return expert_fusion.convert_row(item, part, model=model)

            assert expert_fusion.load_expert_rows(item, saved, convert, release=lambda t: None)
            expected = whole[item.target].reshape(-1)[:item.param.ds_tensor.numel()]
            assert torch.equal(item.param.ds_tensor[:expected.numel()], expected), item.target
            experts = item.param.ds_shape[0]
            row = item.param.ds_numel // experts
            assert len(calls) == math.ceil(item.param.ds_tensor.numel() / row) < experts
            fused += 1
    if model_type == "granitemoe":
        assert fused == 0  # its checkpoint already holds the fused (transposed) tensors
    else:
        assert fused == 2 * model.config.num_hidden_layers - _dense_layers(model), "a fused target fell back"


def _dense_layers(model: torch.nn.Module) -> int:
    """Layers without routed experts (DeepSeek-V3's first_k_dense_replace): two fused targets fewer each."""
    return 2 * int(getattr(model.config, "first_k_dense_replace", 0) or 0)


def test_a_shape_mismatch_copies_nothing_and_asks_for_the_whole_conversion():
    param = _fake_partition(torch.zeros(4, 6, 2), 2)
    item = expert_fusion.ExpertRows("w", param, [[f"e{i}"] for i in range(4)], converter=None, pattern_of={})
    state = {f"e{i}": torch.ones(3, 2) for i in range(4)}
    assert not expert_fusion.load_expert_rows(item, state, lambda part: torch.ones(1, 3, 2), release=lambda t: None)
    assert torch.isnan(param.ds_tensor).all()


def test_copy_range_into_partition_copies_only_the_overlap():
    param = _fake_partition(torch.zeros(10), 2)  # rank 0 holds elements [0, 5)
    expert_fusion.copy_range_into_partition(param, torch.arange(4.0), 3)  # elements [3, 7)
    assert torch.isnan(param.ds_tensor[:3]).all() and param.ds_tensor[3:].tolist() == [0.0, 1.0]
    expert_fusion.copy_range_into_partition(param, torch.arange(2.0), 8)  # another rank's: nothing
    assert param.ds_tensor[3:].tolist() == [0.0, 1.0]
