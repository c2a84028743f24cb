"""``zeromoe_meta.json``: what the strategy records at save time so export needs no model code.

:class:`ExportMeta` is the typed form; :meth:`ExportMeta.to_json` / :meth:`ExportMeta.from_json`
are the only places the file's keys are spelled. Version 1 files (written before the fused
layout, the ZeRO stage and the Hugging Face extras were recorded) are still read: they were
always ZeRO-3 with the ``gate_up_first`` layout, which is what their fields say.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_zeromoe.checkpoint.errors import META_VERSION as META_VERSION_ID
from lightning_zeromoe.checkpoint.errors import NOT_A_CHECKPOINT, ExportError
from lightning_zeromoe.knowledge import say

META_FILE = "zeromoe_meta.json"
META_FORMAT = "lightning_zeromoe/export-meta"
META_VERSION = 2
READABLE_VERSIONS = (1, 2)

#: How a fused gate/up expert tensor is laid out in the user's model (DeepSpeed's names,
#: ``deepspeed/moe/fused_expert_layout.py``): ``gate_up_first`` = ``[E, 2*ffn, hidden]`` with
#: ``down [E, hidden, ffn]``; ``hidden_first`` = ``[E, hidden, 2*ffn]`` with ``down [E, ffn, hidden]``;
#: ``separate``: ``gate``/``up`` as two ``[E, ffn, hidden]`` tensors; ``per_expert``: one module per expert
#: (``targets`` are templates in ``{i}``, e.g. ``layers.0.moe.experts.{i}.gate_proj.weight``; ``gate``/``up``/
#: ``down``, or ``gate_up``/``down`` for a Linear packing gate and up); ``flattened``: ``gate``/``up``/``down``
#: each ``[E * ffn, hidden]``, the down one transposed per expert (DBRX's ``w1``/``v1``/``w2``).
LAYOUTS = ("gate_up_first", "hidden_first", "separate", "per_expert", "flattened")


@dataclass
class ExpertBlock:
    """One AutoEP layer: where DeepSpeed stores its experts and what the model calls them."""

    module_path: str
    num_experts: int
    num_local_experts: int
    ep_size: int
    layout: str
    #: AutoEP weight (``w1``/``w2``/``w3``) -> its DeepSpeed name (``<block>.experts.w1``).
    sources: dict[str, str]
    #: Part (``gate_up``/``down`` or ``gate``/``up``/``down``) -> the model's own name.
    targets: dict[str, str]
    #: ``"model"`` (read from the model: by discovery, or rebuilt at save time) or ``"pattern"`` (the
    #: MoEPattern / autoep_pattern contract, gate_up_first).
    layout_source: str = "pattern"


@dataclass
class ModelInfo:
    """The exported model's class and config, for ``config.json`` and the log."""

    class_name: str = ""
    config: dict[str, Any] | None = None
    config_kind: str | None = None  # "transformers" | "dataclass" | None
    generation_config: dict[str, Any] | None = None
    #: Where the model came from (``config._name_or_path``): the tokenizer lives there.
    name_or_path: str | None = None


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter found at save time (``peft_config[name].to_dict()``)."""

    name: str
    config: dict[str, Any]
    #: Prefix PEFT adds in front of the base model's names (``base_model.model.``).
    peft_prefix: str = "base_model.model."
    #: PEFT ``ParamWrapper`` modules (LoRA on a parameter, ``target_parameters``), by path under the
    #: base model: ``{"parameter": name, "experts": E, "swapped": bool}`` (see :mod:`.lora`).
    param_wrappers: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class ExportMeta:
    """Everything :func:`lightning_zeromoe.checkpoint.export` needs besides the shard files."""

    tag: str
    world_size: int
    ep_size: int
    prefix: str
    dtype: str
    #: DeepSpeed name -> the model's own name, for tensors copied 1:1.
    params: dict[str, str]
    buffers: dict[str, str] = field(default_factory=dict)
    experts: list[ExpertBlock] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)
    #: Own name -> shape the model has (every exported tensor).
    shapes: dict[str, list[int]] = field(default_factory=dict)
    #: Own names of parameters that did not train (``requires_grad=False``).
    frozen: list[str] = field(default_factory=list)
    outside_prefix: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    model: ModelInfo = field(default_factory=ModelInfo)
    lora: list[LoraAdapter] = field(default_factory=list)
    zero_stage: int = 3
    versions: dict[str, str] = field(default_factory=dict)
    version: int = META_VERSION

    def to_json(self) -> str:
        data = {"format": META_FORMAT, **asdict(self)}
        data["version"] = META_VERSION
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = META_FILE) -> "ExportMeta":
        """Parse and check a meta file; :class:`ExportError` names what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ExportError(say(NOT_A_CHECKPOINT, "unreadable-meta", "save-again", source=source, err=err)) from None
        if not isinstance(data, dict) or data.get("format") != META_FORMAT or data.get("version") not in READABLE_VERSIONS:
            found = (data.get("format"), data.get("version")) if isinstance(data, dict) else (type(data).__name__, None)
            raise ExportError(say(META_VERSION_ID, "format-version", "export-with-trained-version",
                                  source=source, found_format=found[0], found_version=found[1],
                                  meta_format=META_FORMAT, versions=list(READABLE_VERSIONS),
                                  trained=data.get('versions', {}).get('lightning-zeromoe', '<version>') if isinstance(data, dict) else '<version>'))
        data = dict(data)
        data.pop("format")
        version = data.pop("version")
        try:
            model = data.pop("model", None) or {}
            if "class" in model:  # version 1 spelling
                model["class_name"] = model.pop("class")
            experts = [ExpertBlock(**{k: v for k, v in e.items() if k != "targets_shapes"})
                       for e in data.pop("experts", [])]
            lora = [LoraAdapter(**a) for a in data.pop("lora", [])]
            meta = cls(**data, model=ModelInfo(**model), experts=experts, lora=lora, version=version)
        except TypeError as err:
            raise ExportError(say(META_VERSION_ID, "fields", "save-again", source=source, version=version,
                                  err=err)) from None
        for block in meta.experts:
            if block.layout not in LAYOUTS:
                raise ExportError(say(META_VERSION_ID, "expert-layout", "matching-version", source=source,
                                      module_path=block.module_path, layout=block.layout, known=list(LAYOUTS)))
        return meta


def read_meta(path: Path) -> ExportMeta:
    try:
        text = path.read_text()
    except OSError as err:
        raise ExportError(say(NOT_A_CHECKPOINT, "unreadable-file", path=path, err=err)) from None
    return ExportMeta.from_json(text, source=str(path))


def same_values(shape: list[int], other: list[int]) -> bool:
    """Whether two shapes differ only by dimensions of size 1 (one tensor, reshaped exactly)."""
    return shape != other and [d for d in shape if d != 1] == [d for d in other if d != 1]
