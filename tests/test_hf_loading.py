"""Unit checks for ``lightning_zeromoe.hf_loading`` (no processes; the 2-rank path is tests/test_pretrained.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_zeromoe import hf_loading


def test_every_private_name_it_relies_on_still_exists():
    """Fails loudly when a transformers or DeepSpeed upgrade removes what the loader replaces or reads."""
    for module_name, names in hf_loading.PRIVATE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert hasattr(module, name), f"{module_name}.{name} is gone: review lightning_zeromoe/hf_loading.py"


def test_layer_groups_keep_one_layers_tensors_together():
    keys = ["model.embed_tokens.weight", "model.layers.0.block_sparse_moe.experts.0.w1.weight",
            "model.layers.0.block_sparse_moe.experts.1.w1.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.layers.10.mlp.gate.weight", "lm_head.weight"]
    groups = hf_loading.layer_groups(keys)
    assert groups == [["model.embed_tokens.weight"], keys[1:3], [keys[3]], [keys[4]], ["lm_head.weight"]]


def test_copy_into_partition_copies_whole_tensors_without_zero_and_reports_shape_mismatches():
    param = torch.nn.Parameter(torch.zeros(3, 4))
    source = torch.arange(12.0).reshape(3, 4)
    assert hf_loading.copy_into_partition(param, source, "w") is None
    assert torch.equal(param.data, source)
    error = hf_loading.copy_into_partition(param, torch.zeros(4, 3), "w")
    assert error is not None and "size mismatch for w" in error and "(4, 3)" in error


def test_release_pages_never_changes_data(tmp_path):
    """Anonymous memory is left alone; a memory-mapped checkpoint tensor reads the same afterwards."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    anon = torch.randn(1_000_000)
    copy = anon.clone()
    hf_loading.release_pages(anon)
    assert torch.equal(anon, copy)
    save_file({"a": copy}, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        mapped = f.get_tensor("a")
    assert hf_loading._private_file_mapping(mapped.data_ptr(), mapped.data_ptr() + 4) is not None, \
        "safetensors no longer memory-maps tensors: the loader's page release does nothing"
    first = mapped.sum().item()
    hf_loading.release_pages(mapped)
    assert mapped.sum().item() == pytest.approx(first) and torch.equal(mapped, copy)


def test_transformers_zero3_is_scoped():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    with hf_loading.transformers_zero3({"zero_optimization": {"stage": 3}}):
        assert is_deepspeed_zero3_enabled()
    assert not is_deepspeed_zero3_enabled()
    with hf_loading.transformers_zero3({"zero_optimization": {"stage": 2}}):
        assert not is_deepspeed_zero3_enabled()
