"""Our own errors carry their knowledge-base entry: each message starts with ``[<entry-id>] ``,
the exception has ``entry_id``, and ``knowledge.match`` (what ``explain`` uses) finds that entry.

The messages are the real ones: triggered in-process the way tests/test_validation.py and
tests/test_pitfalls.py trigger them (a real Trainer + strategy ``prepare()``; the guard on a real
module; the audit report built from its own dataclasses; ``export`` on bad directories), and, for
the device-move error that needs ZeRO-3 parameters, in the one-process job
tests/jobs/claims_job.py (shared with tests/test_knowledge_claims.py).
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from lightning_zeromoe import MoEPattern, checkpoint

from lightning_zeromoe.engine import pitfalls
from lightning_zeromoe.checkpoint.export import check_output, target_dtype
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
from lightning_zeromoe.config.schema import BatchSection
from lightning_zeromoe.config.validation import Layout, ZeroMoEConfigError, check_batch_arithmetic, check_layout
from support.claims import claims
from support.knowledge_scan import OWN_PATTERNS
from support.modules import DenseModule, MovesItself, NativeMoEModule, prepared
from troubleshooter import knowledge

PREFIX = re.compile(r"^\[(?P<id>[a-z0-9]+(?:[.-][a-z0-9]+)*)\] ")


def _config_errors() -> list[ZeroMoEConfigError]:
    import lightning as L

    from lightning_zeromoe import ZeroMoEStrategy

    cases = [
        lambda: L.Trainer(accelerator="cpu", devices=2, strategy=ZeroMoEStrategy(ep_size=3), logger=False),
        lambda: prepared(TinyMoEModule(TinyMoEConfig(num_experts=3)), ep_size=2),
        lambda: prepared(TinyMoEModule(), ep_size=2, moe_pattern=MoEPattern(block=r"model\.layers\.\d+\.mlp", top_k=8)),
        lambda: prepared(DenseModule(), ep_size=2),
        lambda: prepared(NativeMoEModule(), ep_size=1),
        lambda: prepared(NativeMoEModule(ep_size=2), ep_size=1, stage=2),
        lambda: prepared(NativeMoEModule(ep_size=1, second_ep_size=2), stage=2),
        lambda: prepared(NativeMoEModule(ep_size=2), stage=2, config={"expert_parallel": {"enabled": True}}),
        lambda: prepared(TinyMoEModule(), ep_size=2, config={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}),
        lambda: check_batch_arithmetic(BatchSection(gradient_accumulation_steps=4), 2, 1),
        lambda: prepared(TinyMoEModule(), ep_size=2, moe_pattern=MoEPattern(block=r"model\.layers\.\d+\.mlp", top_k=0)),
    ]
    errors = []
    for case in cases:
        with pytest.raises(ZeroMoEConfigError) as err:
            case()
        errors.append(err.value)
    return errors


def _check(message: str, expected: str | None = None) -> str:
    """The message starts with its entry id, and knowledge.match finds that entry first."""
    prefix = PREFIX.match(message)
    assert prefix, f"no [entry-id] prefix: {message[:120]!r}"
    entry_id = prefix.group("id")
    assert expected in (None, entry_id), (expected, message[:120])
    matches = knowledge.match(message)
    assert matches and matches[0].entry.id == entry_id, (entry_id, [m.entry.id for m in matches])
    if entry_id in OWN_PATTERNS:  # the entry's own patterns recognise the text without the prefix too
        bare = message[prefix.end():]
        assert any(m.entry.id == entry_id for m in knowledge.match(bare)), (entry_id, bare[:120])
    return entry_id


def test_every_validation_error_names_its_entry():
    ids = set()
    for err in _config_errors():
        ids.add(_check(str(err), err.entry_id))
    assert ids == {"ep-size-divisibility", "moe-top-k-range", "autoep-no-moe-layers", "native-moe-zero3", "native-moe-ep-size",
                   "batch-arithmetic", "lightning-gradient-accumulation"}


def test_validation_warnings_name_their_entry():
    found = discover(TinyMoEModule())
    warned = check_layout(Layout(world_size=4, devices_per_node=2, ep_size=4, stage=3, precision="16-mixed"), found)
    assert {_check(w) for w in warned} == {"ep-size-crosses-nodes", "fp16-moe"}


def test_pitfall_warnings_and_audit_messages_name_their_entry():
    net = MovesItself()
    guard = pitfalls.DeviceMoveGuard(net, torch.device("cpu")).install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net(torch.ones(1, 2))
    finally:
        guard.remove()
    [noop] = [str(w.message) for w in caught]
    assert _check(noop) == "zero3-noop-move"
    report = pitfalls.AuditReport(steps=3, stale=[pitfalls.StaleParameter("sidecar.weight", 1, 2)],
                                  aliases=[pitfalls.AliasedAttribute("sidecar.cached", "sidecar.weight", 256)])
    assert [_check(m) for m in report.messages()] == ["zero3-no-gradient", "zero3-aliased-weight"]


def test_device_move_error_names_its_entry():
    moved = json.loads(claims()["device_move"])
    assert moved["entry_id"] == pitfalls.ZeroDeviceMoveError.entry_id == "zero3-module-move"
    assert _check(moved["message"], "zero3-module-move") and ".half()" in moved["message"]


def test_export_errors_name_their_entry(tmp_path):
    file = tmp_path / "model.ckpt"
    file.write_text("x")
    out = tmp_path / "out.safetensors"
    cases = {tmp_path / "missing": "export-not-a-checkpoint", file: "export-not-a-checkpoint",
             tmp_path: "export-not-a-checkpoint"}
    for ckpt, expected in cases.items():
        with pytest.raises(checkpoint.ExportError) as err:
            checkpoint.export(ckpt, out, progress=False)
        assert err.value.entry_id == expected
        _check(str(err.value), expected)
    with pytest.raises(checkpoint.ExportError) as err:
        check_output(file, tmp_path / "ckpt", overwrite=False)
    _check(str(err.value), "export-output-path")


def test_export_dtype_refusals_name_their_entry():
    """An unknown dtype, and float32 from a bf16 stage-1/2 checkpoint (only an upcast there)."""
    from types import SimpleNamespace

    bf16_stage2 = SimpleNamespace(dtype="bfloat16", zero_stage=2)
    for dtype, phrase in (("int8", "unsupported dtype 'int8'"), ("float32", "would only be an upcast")):
        with pytest.raises(checkpoint.ExportError) as err:
            target_dtype(dtype, bf16_stage2)
        assert err.value.entry_id == "export-dtype" and phrase in str(err.value)
        _check(str(err.value), "export-dtype")
    assert str(target_dtype("auto", bf16_stage2)) == "torch.bfloat16"


def test_every_own_error_entry_exists_and_the_prefix_alone_is_recognised():
    for entry_id in ("zero3-module-move", "export-shards-mismatch", "export-output-path", "moe-top-k-range"):
        assert knowledge.match(f"RuntimeError: [{entry_id}] anything")[0].entry.id == entry_id
    assert not knowledge.match("see [batch-arithmetic]: x")  # a citation in prose is not an error
