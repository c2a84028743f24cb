"""Unit checks for ``lightning_zeromoe.loading.hf_zero3`` (no processes; the 2-rank path is tests/test_pretrained.py)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.loading import hf_zero3 as hf_loading

from lightning_zeromoe.loading import memory_release


def test_every_private_name_it_relies_on_still_exists():
    """Fails loudly when a transformers or DeepSpeed upgrade removes what the loader replaces or reads."""
    for module_name, names in hf_loading.PRIVATE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert hasattr(module, name), f"{module_name}.{name} is gone: review lightning_zeromoe/loading/hf_zero3.py"


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


def _mapped_tensors(tmp_path, tensors):
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(tensors, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _resident_bytes(tensor):
    """Bytes of ``tensor``'s pages present in this process (``/proc/self/pagemap`` bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = tensor.data_ptr() // page
    hi = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        entries = torch.frombuffer(bytearray(f.read((hi - lo) * 8)), dtype=torch.int64)
    return int((entries < 0).sum()) * page


def test_release_pages_never_changes_data(tmp_path):
    """Anonymous memory is left alone; a memory-mapped checkpoint tensor reads the same afterwards."""
    anon = torch.randn(1_000_000)
    copy = anon.clone()
    mapped = _mapped_tensors(tmp_path, {"a": copy})["a"]
    pages = memory_release.FilePages()
    pages.release(anon)
    assert torch.equal(anon, copy)
    assert pages.mapping_of(mapped) is not None, \
        "safetensors no longer memory-maps tensors: the loader's page release does nothing"
    first = mapped.sum().item()
    assert _resident_bytes(mapped) > 3_000_000
    pages.release(mapped)
    assert _resident_bytes(mapped) <= 2 * os.sysconf("SC_PAGE_SIZE"), "more than its two partial end pages stay"
    assert mapped.sum().item() == pytest.approx(first) and torch.equal(mapped, copy)


def test_release_mappings_drops_what_safetensors_touched_but_never_a_written_page(tmp_path):
    """safetensors touches the first page of every tensor it hands out (and the kernel maps its
    cached neighbours); ``release_mappings`` takes those out, unless the process wrote to the mapping."""
    source = {f"t{i}": torch.randn(64, 1024) for i in range(8)}  # 256 KiB each
    mapped = _mapped_tensors(tmp_path, source)
    for t in mapped.values():
        t.sum()
    touched = sum(_resident_bytes(t) for t in mapped.values())
    assert touched >= 8 * 256 * 1024 - 8 * os.sysconf("SC_PAGE_SIZE")
    pages = memory_release.FilePages()
    assert pages.release_mappings(mapped.values()) > 0
    assert sum(_resident_bytes(t) for t in mapped.values()) == 0
    assert all(torch.equal(mapped[k], source[k]) for k in source)

    (tmp_path / "w").mkdir()
    written = _mapped_tensors(tmp_path / "w", source)
    written["t3"][0, 0] = 42.0  # a private copy of that page now holds the only 42
    pages = memory_release.FilePages()
    assert pages.release_mappings(written.values()) == 0
    assert written["t3"][0, 0].item() == 42.0


def test_trim_after_each_partition_trims_for_partitioned_modules_only(monkeypatch):
    """The hook is active only inside the context, and fires for a module holding a ZeRO-3
    partition (``ds_tensor``) of at least 2**18 elements: not for small or unpartitioned ones."""
    calls = []
    monkeypatch.setattr(memory_release, "trim_heap", lambda: calls.append(1))

    def partitioned(numel):
        module = torch.nn.Linear(1, 1)
        module.weight.ds_tensor = torch.empty(0)
        module.weight.ds_numel = numel
        return module

    parent = torch.nn.Module()
    with memory_release.trim_after_each_partition():
        parent.big = partitioned(1 << 18)
        parent.small = partitioned(1000)
        parent.plain = torch.nn.Linear(1024, 1024)
    assert len(calls) == 1
    parent.late = partitioned(1 << 20)
    with memory_release.trim_after_each_partition(enabled=False):
        parent.off = partitioned(1 << 20)
    assert len(calls) == 1


def test_transformers_zero3_is_scoped():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    with hf_loading.transformers_zero3(DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3}})):
        assert is_deepspeed_zero3_enabled()
    assert not is_deepspeed_zero3_enabled()
    with hf_loading.transformers_zero3(DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 2}})):
        assert not is_deepspeed_zero3_enabled()
