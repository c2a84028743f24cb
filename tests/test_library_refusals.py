"""Refusals of the demo, discovery and the collectives layer carry their knowledge-base entry.

Each is triggered for real (the demo's accelerator check on this machine, discovery on two real
Hugging Face MoE models, the collectives layer on backend strings it cannot place), and the
message is recognised by ``knowledge.match`` (what ``troubleshooter explain`` runs) as its entry.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zeromoe.engine.collectives import UnknownBackendError, device_for_backend
from troubleshooter import knowledge


def _entry(text: str) -> str:
    assert knowledge.entry_of(text) is not None, text
    assert knowledge.match(f"Traceback ...\nValueError: {text}")[0].entry.id == knowledge.entry_of(text)
    return knowledge.entry_of(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device")
def test_demo_refuses_gpu_without_cuda():
    from lightning_zeromoe.demo import resolve_accelerator

    with pytest.raises(SystemExit) as err:
        resolve_accelerator("gpu", 1)
    text = str(err.value.code)
    assert _entry(text) == "demo-accelerator"
    assert "no CUDA device is visible" in text and "--accelerator cpu" in text
    assert resolve_accelerator("auto", 2)[:2] == ("cpu", 2)


def test_collectives_refusals_name_their_entry():
    cases = [
        lambda: device_for_backend("cpu:gloo,cuda"),
        lambda: device_for_backend("undefined", accelerator="tpu", default_device_backend_map={"cpu": "gloo"},
                                   backend_capability={}),
        lambda: device_for_backend("foo", default_device_backend_map={"cpu": "gloo"}, backend_capability={}),
    ]
    texts = []
    for case in cases:
        with pytest.raises(UnknownBackendError) as err:
            case()
        texts.append(str(err.value))
    assert [_entry(t) for t in texts] == ["collective-backend"] * 3
    assert "'cuda' is not a 'device:backend' pair" in texts[0]
    assert texts[1].endswith("accelerator 'tpu'; pass one to init_process_group (e.g. 'nccl', 'gloo', "
                             "'cpu:gloo,cuda:nccl')")
    assert "'cpu:gloo,cuda:foo'" in texts[2]


def test_two_hf_moe_models_refusal_names_its_entry():
    import lightning as L
    from support import hf_zoo

    from lightning_zeromoe.discovery.find import discover

    class TwoModels(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = hf_zoo.build("mixtral")
            self.student = hf_zoo.build("mixtral", seed=1)

    with pytest.raises(ValueError) as err:
        discover(TwoModels())
    assert _entry(str(err.value)) == "autoep-several-models"
    assert "(teacher (mixtral), student (mixtral))" in str(err.value) and "moe_pattern=MoEPattern" in str(err.value)


def test_a_pattern_whose_routing_cannot_be_written_names_its_entry():
    """A MoEPattern without top_k on blocks of a model with no Hugging Face config: discovery stops
    with the pattern, the reason and the fixes, before any process group."""
    from lightning_zeromoe import MoEPattern
    from lightning_zeromoe.discovery.find import discover
    from lightning_zeromoe.reference.models import TinyMoEModule

    with pytest.raises(ValueError) as err:
        discover(TinyMoEModule(), MoEPattern(block=r"model\.layers\.\d+\.mlp"))
    text = str(err.value)
    assert _entry(text) == "moe-pattern-routing"
    assert text.startswith("[moe-pattern-routing] MoEPattern(block='model\\\\.layers\\\\.\\\\d+\\\\.mlp'): no top_k")
    assert "top_k=" in text and "ep_size=1" in text
    assert not torch.distributed.is_initialized()
