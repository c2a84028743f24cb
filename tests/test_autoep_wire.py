"""The AutoEP section DeepSpeed receives: no warning about fields we chose, the same layers converted.

deepspeed 0.19.8 warns ``Custom preset fields ['moe_layer_pattern'] are set alongside
preset_model='mixtral'`` at every engine build on every rank when both are sent; the strategy
re-roots the preset's pattern for a model held under the LightningModule, so it used to send both
(``lightning_zeromoe/config/autoep_wire.py`` says why leaving ``preset_model`` out changes nothing else).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from typing import Any

import pytest
from torch import nn

from support import hf_zoo
from lightning_zeromoe.config.autoep_wire import config_for_deepspeed, custom_fields, section_for_deepspeed
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.engine.build import lend_root_config

WARNING = "Custom preset fields"


class _Captured:
    """DeepSpeed's logger records at WARNING and above, while the block runs."""

    def __enter__(self) -> "_Captured":
        from deepspeed.utils import logger

        self.logger, self.stream = logger, io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setLevel(logging.WARNING)
        logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)

    @property
    def text(self) -> str:
        return self.stream.getvalue()


def _specs_and_warnings(root: nn.Module, section: dict[str, Any], lend: Any) -> tuple[list[dict], str]:
    """DeepSpeed's own config check and layer detection, as ``deepspeed.initialize`` runs them."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

    with _Captured() as captured:
        validate_autoep_config(parse_autoep_config(section), 1, 1, 1, 1)
    with lend_root_config(root, lend):
        specs = AutoEP(root, parse_autoep_config(section)).ep_parser()
    return [dataclasses.asdict(s) for s in specs], captured.text


#: Three preset families and one without a preset (found by structure, its own custom section).
ZOO = {"mixtral": "hf:mixtral", "qwen3_moe": "hf:qwen3_moe", "deepseek_v3": "hf:deepseek_v3",
       "olmoe": "hf:custom:olmoe"}


@pytest.mark.parametrize("model_type", sorted(ZOO))
def test_section_sent_converts_the_same_layers_and_draws_no_preset_warning(model_type: str) -> None:
    root = nn.Module()
    root.net = hf_zoo.build(model_type)
    found = discover(root)
    assert found.source == ZOO[model_type] and len(found.blocks) == 2
    built = {"enabled": True, "autoep_size": 1, "use_grouped_mm": False, **found.autoep}
    sent = section_for_deepspeed(built, found.root_config)
    old_specs, old_log = _specs_and_warnings(root, built, found.root_config)
    new_specs, new_log = _specs_and_warnings(root, sent, found.root_config)
    assert WARNING not in new_log, new_log
    assert new_specs == old_specs  # every field of every detected layer: same layers, same routing
    assert [s["moe_module_name"] for s in new_specs] == [b.path for b in found.blocks]
    if found.source.startswith("hf:custom"):
        assert sent == built and "preset_model" not in built  # nothing to leave out
    else:
        # The re-rooted pattern next to the preset drew the warning; it is what is still sent.
        assert built["preset_model"] and custom_fields(built) == ["moe_layer_pattern"]
        assert WARNING in old_log and f"preset_model='{built['preset_model']}'" in old_log
        assert sent == {k: v for k, v in built.items() if k != "preset_model"}


def test_preset_model_is_kept_where_autoep_would_not_pick_it_itself() -> None:
    section = {"enabled": True, "preset_model": "mixtral", "moe_layer_pattern": r"net\.model\.layers\.\d+\.mlp"}
    assert section_for_deepspeed(section, None) == section  # no config lent: AutoEP could not pick it
    assert section_for_deepspeed(section, type("C", (), {"model_type": "qwen3_moe"})()) == section
    assert section_for_deepspeed({"preset_model": "mixtral"}, type("C", (), {"model_type": "mixtral"})()) == {
        "preset_model": "mixtral"}  # nothing custom next to it: DeepSpeed says nothing
    tp = {"expert_parallel": section, "tensor_parallel": {"preset_model": "mixtral"}}
    assert config_for_deepspeed(tp, type("C", (), {"model_type": "mixtral"})()) == tp
