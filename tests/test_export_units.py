"""Export's pure parts on fake ranks built from ``torch.arange``: no DeepSpeed, no subprocess.

The fake ranks are partitioned the way ZeRO-3 does it (``ceil(numel / n)`` values of every
parameter per rank, in order, the last piece padded), so rebuilding them must give back the
original tensors exactly. The real multi-rank layouts are covered by ``tests/test_checkpoint.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_zeromoe.checkpoint.errors import ExportError
from lightning_zeromoe.checkpoint.meta import ExpertBlock, ExportMeta
from lightning_zeromoe.checkpoint.partition import (GroupRecord, flat_slices, global_expert_ids, group_records,
                                                    join_pieces, partition_members, read_slice, stack_experts)
from lightning_zeromoe.checkpoint.plan import expert_outputs
from lightning_zeromoe.checkpoint.sources import ExpertSource, Reader


def _partition(tensors: dict[str, torch.Tensor], count: int) -> list[torch.Tensor]:
    """What ZeRO-3 keeps per rank: each tensor split into ``count`` equal padded pieces."""
    flats: list[list[torch.Tensor]] = [[] for _ in range(count)]
    for t in tensors.values():
        part = math.ceil(t.numel() / count)
        padded = torch.cat([t.reshape(-1), torch.full((part * count - t.numel(),), -1.0)])
        for r in range(count):
            flats[r].append(padded[r * part:(r + 1) * part])
    return [torch.cat(f) for f in flats]


def _tensors() -> dict[str, torch.Tensor]:
    # Sizes that do and do not divide by 2 and 3, so padding sits mid-partition.
    return {"a": torch.arange(7.0).reshape(7), "b": torch.arange(100.0, 112.0).reshape(3, 4),
            "c": torch.arange(200.0, 205.0).reshape(5, 1)}


@pytest.mark.parametrize("count", [1, 2, 3])
def test_flat_partitions_unflatten_into_the_named_tensors(count):
    tensors = _tensors()
    flats = _partition(tensors, count)
    slices = flat_slices({n: t.shape for n, t in tensors.items()}, count)
    assert [s.name for s in slices] == list(tensors)
    for s in slices:
        got = join_pieces([read_slice(f, s, where=f"rank {r}") for r, f in enumerate(flats)], s.shape)
        assert torch.equal(got, tensors[s.name]), s.name


def test_a_short_partition_is_refused_with_the_tensor_named():
    flats = _partition(_tensors(), 2)
    slices = flat_slices({n: t.shape for n, t in _tensors().items()}, 2)
    with pytest.raises(ExportError, match=r"^\[export-shards-mismatch\] rank 1: .* before c"):
        read_slice(flats[1][:-2], slices[-1], where="rank 1")


def test_partition_members_orders_ranks_by_partition_rank():
    # World 4, EP 2: dense group over all ranks; each EP rank's experts over its 2 data-parallel replicas.
    records = [[GroupRecord((0, 1, 2, 3), r), GroupRecord((0, 2) if r % 2 == 0 else (1, 3), r // 2, ("autoep_expert",))]
               for r in range(4)]
    assert partition_members(records, 0) == {(0, 1, 2, 3): [0, 1, 2, 3]}
    assert partition_members(records, 1) == {(0, 2): [0, 2], (1, 3): [1, 3]}
    assert records[0][1].is_expert and not records[0][0].is_expert


def test_partition_members_refuses_missing_and_doubled_ranks():
    missing = [[GroupRecord((0, 1, 2), 0)], [GroupRecord((0, 1, 2), 2)]]
    with pytest.raises(ExportError, match=r"partition ranks 0..2 of \[0, 1, 2\] expected, found \[0, 2\]"):
        partition_members(missing, 0)
    doubled = [[GroupRecord((0, 1), 0)], [GroupRecord((0, 1), 0)]]
    with pytest.raises(ExportError, match="both claim partition rank 0"):
        partition_members(doubled, 0)


def test_group_records_without_autoep_span_the_world():
    assert group_records(None, num_groups=2, rank=1, world_size=2) == [GroupRecord((0, 1), 1)] * 2
    raw = [{"partition_ranks": [0], "partition_rank": 0, "families": ["autoep_expert"]}]
    assert group_records(raw, num_groups=1, rank=0, world_size=2)[0].is_expert


def test_experts_from_two_ep_ranks_are_stacked_in_global_order():
    full = torch.arange(4 * 3 * 2.0).reshape(4, 3, 2)
    layer0 = {"ep_rank": 1, "expert_placement": {"ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2, 3]}]}}
    assert global_expert_ids(layer0) == [2, 3]
    assert global_expert_ids({"ep_rank": 0, "global_expert_start": 0, "global_expert_end": 2}) == [0, 1]
    parts = {2: full[2], 3: full[3], 0: full[0], 1: full[1]}
    assert torch.equal(stack_experts(parts, 4, name="w1"), full)
    with pytest.raises(ExportError, match=r"experts \[0, 1, 3\] found, expected 0..3"):
        stack_experts({0: full[0], 1: full[1], 3: full[3]}, 4, name="w1")


class _Fixed:
    """A source holding a fixed tensor (what a rank's shard piece would hold)."""

    def __init__(self, tensor):
        self.tensor = tensor


class _Reader(Reader):
    def read(self, source):
        return source.tensor if isinstance(source, _Fixed) else super().read(source)


def _by_ep_rank(name: str, t: torch.Tensor) -> ExpertSource:
    """The pieces 2 expert-parallel ranks hold: rank 1 the odd experts, rank 0 the even ones."""
    return ExpertSource(name, t.shape[0], (((1, 3), _Fixed(t[1::2].contiguous())), ((0, 2), _Fixed(t[0::2].contiguous()))))


@pytest.mark.parametrize("pieces", ["whole", "expert_parallel"])
@pytest.mark.parametrize("layout", ["gate_up_first", "hidden_first", "separate"])
def test_experts_go_back_to_the_layout_the_model_used(layout, pieces):
    """AutoEP's repack (deepspeed/moe/ep_repack.py) applied to an arange model tensor, then undone,
    from whole tensors (ZeRO-1/2 files stacked) or from 2 expert-parallel ranks' pieces."""
    e, ffn, hidden = 4, 3, 2
    if layout == "gate_up_first":
        gate_up = torch.arange(e * 2 * ffn * hidden * 1.0).reshape(e, 2 * ffn, hidden)
        down = -torch.arange(e * hidden * ffn * 1.0).reshape(e, hidden, ffn)
        w1, w3, w2 = gate_up[:, :ffn], gate_up[:, ffn:], down
        targets, want = {"gate_up": "gu", "down": "d"}, {"gu": gate_up, "d": down}
    elif layout == "hidden_first":
        gate_up = torch.arange(e * hidden * 2 * ffn * 1.0).reshape(e, hidden, 2 * ffn)
        down = -torch.arange(e * ffn * hidden * 1.0).reshape(e, ffn, hidden)
        w1, w3, w2 = gate_up[:, :, :ffn].transpose(1, 2), gate_up[:, :, ffn:].transpose(1, 2), down.transpose(1, 2)
        targets, want = {"gate_up": "gu", "down": "d"}, {"gu": gate_up, "d": down}
    else:
        w1, w3 = torch.arange(e * ffn * hidden * 1.0).reshape(e, ffn, hidden), -torch.arange(e * ffn * hidden * 1.0).reshape(e, ffn, hidden)
        w2 = torch.arange(e * hidden * ffn * 1.0).reshape(e, hidden, ffn)
        targets, want = {"gate": "g", "up": "u", "down": "d"}, {"g": w1, "u": w3, "d": w2}
    block = ExpertBlock("m", e, e // 2, 2, layout, {}, targets)
    wrap = (lambda n, t: _Fixed(t.contiguous())) if pieces == "whole" else _by_ep_rank
    built = expert_outputs(block, {"w1": wrap("w1", w1), "w2": wrap("w2", w2), "w3": wrap("w3", w3)},
                           {n: list(t.shape) for n, t in want.items()})
    assert set(built) == set(want)
    for name, build in built.items():
        assert torch.equal(build(_Reader()), want[name]), name


def test_expert_pieces_must_cover_every_expert():
    t = torch.arange(8.0).reshape(4, 2)
    holes = ExpertSource("w1", 4, (((0, 1), _Fixed(t[:2])), ((1, 2), _Fixed(t[2:]))))
    with pytest.raises(ExportError, match=r"w1: experts \[0, 1, 1, 2\] found, expected 0..3"):
        _Reader().read(holes)


def test_meta_round_trips_and_refuses_other_versions():
    meta = ExportMeta(tag="checkpoint", world_size=2, ep_size=2, prefix="model.", dtype="float32",
                      params={"model.x": "x"}, shapes={"x": [2]},
                      experts=[ExpertBlock("model.l.mlp", 4, 2, 2, "hidden_first", {"w1": "a"}, {"gate_up": "b"})])
    again = ExportMeta.from_json(meta.to_json())
    assert again == meta and again.experts[0].layout == "hidden_first"
    data = json.loads(meta.to_json())
    with pytest.raises(ExportError, match=r"^\[export-meta-version\] .* version 99"):
        ExportMeta.from_json(json.dumps({**data, "version": 99}))
    with pytest.raises(ExportError, match="expert layout 'sideways'"):
        data["experts"][0]["layout"] = "sideways"
        ExportMeta.from_json(json.dumps(data))


def test_version_1_meta_is_still_read():
    v1 = {"format": "lightning_zeromoe/export-meta", "version": 1, "tag": "checkpoint", "world_size": 2, "ep_size": 2,
          "prefix": "model.", "dtype": "float32", "params": {}, "buffers": {}, "tied": [], "shapes": {},
          "outside_prefix": [], "unsupported": [], "versions": {},
          "model": {"class": "m.C", "config": None, "config_kind": None},
          "experts": [{"module_path": "model.l", "num_experts": 4, "num_local_experts": 2, "ep_size": 2,
                       "layout": "gate_up_first", "sources": {}, "targets": {}}]}
    meta = ExportMeta.from_json(json.dumps(v1))
    assert meta.zero_stage == 3 and meta.model.class_name == "m.C" and meta.experts[0].layout == "gate_up_first"


def test_lora_merge_and_adapter_names():
    """W + (alpha / r) * B @ A under the base name; the adapter under PEFT's saved names."""
    from lightning_zeromoe.checkpoint.lora import split_lora
    from lightning_zeromoe.checkpoint.meta import LoraAdapter
    from lightning_zeromoe.checkpoint.plan import OutputTensor

    w, a, b = torch.arange(12.0).reshape(3, 4), torch.arange(8.0).reshape(2, 4) / 10, torch.arange(6.0).reshape(3, 2)
    fixed = lambda t: (lambda reader: t)  # noqa: E731
    outputs = [OutputTensor("m.q.base_layer.weight", (3, 4), fixed(w)), OutputTensor("m.q.base_layer.bias", (3,), fixed(w[:, 0])),
               OutputTensor("m.q.lora_A.default.weight", (2, 4), fixed(a)),
               OutputTensor("m.q.lora_B.default.weight", (3, 2), fixed(b)), OutputTensor("m.norm.weight", (4,), fixed(w[0]))]
    adapter = LoraAdapter("default", {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "use_rslora": False})
    merged, tensors = split_lora(outputs, [adapter])
    assert [o.name for o in merged] == ["m.q.weight", "m.q.bias", "m.norm.weight"]
    assert torch.allclose(merged[0].build(None), w + 4.0 * (b @ a))
    assert torch.equal(merged[1].build(None), w[:, 0])
    assert [o.name for o in tensors] == ["base_model.model.m.q.lora_A.weight", "base_model.model.m.q.lora_B.weight"]
    rs = LoraAdapter("default", {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "use_rslora": True})
    assert torch.allclose(split_lora(outputs, [rs])[0][0].build(None), w + 8 / math.sqrt(2) * (b @ a))
    with pytest.raises(ExportError, match=r"^\[export-unsupported-model\] .*use_dora=True"):
        split_lora(outputs, [LoraAdapter("default", {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "use_dora": True})])


def test_a_bf16_runs_optimizer_shards_are_found(tmp_path):
    """DeepSpeed names a bf16 run's optimizer shards ``bf16_zero_pp_rank_R_...`` (every GPU run);
    the exporter refused them as missing until benchmarks/gpu_check.py's CPU fallback tried one."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from lightning_zeromoe.checkpoint.sources import _optim_states_of

    model = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model.write_bytes(b"")
    plain = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert _optim_states_of(model) == plain  # fp32 run: the plain name (reported missing when absent)
    prefix = DeepSpeedEngine._get_zero_ckpt_prefix(None, 0, bf16_mode=True)  # DeepSpeed's own naming
    bf16 = tmp_path / f"{prefix}_mp_rank_00_optim_states.pt"
    bf16.write_bytes(b"")
    assert _optim_states_of(model) == bf16
