"""What discovery returns, and what every source of it shares.

:class:`Discovery` is the one result of :func:`lightning_zeromoe.discovery.find.discover`, whatever the
model: the blocks AutoEP will convert (:class:`MoEBlock`), the blocks that train under ZeRO-3
without expert parallelism and why (:class:`FallbackBlock`), and the ``expert_parallel`` keys that
locate the blocks. :func:`one_kind` is the single rule for which structurally found blocks are
converted (AutoEP converts one block layout per engine), and :meth:`Discovery.no_ep_warning` the
single message for a model none of whose MoE blocks converts, for every kind of model (Hugging
Face, hand-written, ``MoEPattern``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_zeromoe.discovery.hf_semantics import Routing
from lightning_zeromoe.discovery.structure import BlockLayout
from lightning_zeromoe.knowledge import say

#: Knowledge-base entry of the warning for MoE blocks of which none gets expert parallelism.
NO_EP_ENTRY = "moe-no-expert-parallel"


@dataclass(frozen=True)
class MoEPattern:
    """Where a custom model's MoE blocks are, in AutoEP's terms, and how they route.

    ``block`` is a regex over module names *relative to the LightningModule* (what
    ``named_modules()`` prints), e.g. ``r"model\\.layers\\.\\d+\\.moe"``. The block must have a
    router child named by the ``router`` field (default ``"gate"``: a Linear of shape
    ``[num_experts, hidden]``) and an experts child named by ``experts`` (default ``"experts"``)
    holding fused 3-D weights (the attributes named by ``w1``, default ``"gate_up_proj"``, and
    ``w2``, default ``"down_proj"``: ``w1`` = ``[E, 2*ffn, hidden]`` gate+up when ``w3`` is None, or
    separate ``w1``/``w3`` of ``[E, ffn, hidden]``; ``w2`` = ``[E, hidden, ffn]``), or a
    ``ModuleList`` of expert MLPs whose Linear children ``w1``/``w3``/``w2`` are gate, up and down
    (``MoEPattern(..., w1="gate_proj", w2="down_proj", w3="up_proj")``). Hand-written blocks of
    that kind are also found without a pattern (:mod:`lightning_zeromoe.discovery.block_probe`).

    Routing fields left at None are read from the Hugging Face config of the model that holds the
    blocks (:func:`lightning_zeromoe.discovery.hf_semantics.routing_from_config`), never from AutoEP's
    custom defaults; for a model without an HF config they default to softmax, renormalised
    top-k, scale 1 (what :class:`~lightning_zeromoe.reference.models.TinyMoELM` does). Either way the
    setup-time probe proves them per block before training.
    """

    block: str
    top_k: int | None = None
    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"
    w3: str | None = None
    score_func: str | None = None
    route_norm: bool | None = None
    route_scale: float | None = None
    shared_experts: str | None = None
    shared_experts_gate: str | None = None
    expert_activation: str | None = None

    def routing_overrides(self) -> dict[str, Any]:
        return {"score_func": self.score_func, "route_norm": self.route_norm, "route_scale": self.route_scale,
                "top_k": self.top_k, "shared_experts": self.shared_experts,
                "shared_experts_gate": self.shared_experts_gate, "expert_activation": self.expert_activation}

    def autoep_section(self, routing: Routing | None = None) -> dict[str, Any]:
        section = {
            "moe_layer_pattern": self.block,
            "router_pattern": self.router,
            "expert_pattern": self.experts,
            "expert_w1": self.w1,
            "expert_w2": self.w2,
            "expert_w3": self.w3,
        }
        if self.top_k is not None:
            section["top_k"] = self.top_k
        if routing is not None:
            section.update(routing.autoep_keys())
        return section


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block found in the module tree, with what export needs to restore it.

    ``layout`` holds the model's own names (router weight, expert tensors, fused layout, extra
    routing tensors such as DeepSeek-V3's ``e_score_correction_bias``); ``routing`` the semantics
    the AutoEP section was built from. Both are None for self-described non-HF modules.
    """

    path: str
    num_experts: int
    top_k: int | None
    layout: BlockLayout | None = field(default=None, compare=False)
    routing: Routing | None = field(default=None, compare=False)
    #: The original block returns ``(hidden, router_logits)``; the converted layer must too (Llama-4).
    returns_tuple: bool = False


@dataclass(frozen=True)
class FallbackBlock:
    """An MoE block that trains under ZeRO-3 without expert parallelism, and why."""

    path: str
    reason: str
    block_class: str = ""
    layout: BlockLayout | None = field(default=None, compare=False)


@dataclass
class Discovery:
    """What the strategy learned about the model's MoE layers before any engine exists."""

    source: str  # "pattern" | "hf:<preset>" | "hf:custom:<model_type>" | "self-described" | "none"
    #: Blocks AutoEP will convert (expert parallel), pending the setup-time probe.
    blocks: list[MoEBlock] = field(default_factory=list)
    #: The ``expert_parallel`` keys that locate the blocks (no ``enabled``/``autoep_size``).
    autoep: dict[str, Any] = field(default_factory=dict)
    #: Lent to the root as ``.config`` during ``deepspeed.initialize`` (HF models only).
    root_config: Any = None
    #: Paths of native ``deepspeed.moe.layer.MoE`` modules (refused under ZeRO-3).
    native_moe: list[str] = field(default_factory=list)
    #: The ``ep_size`` each of those was built with (path -> size; :mod:`lightning_zeromoe.config.native_moe`).
    native_ep_sizes: dict[str, int] = field(default_factory=dict)
    #: Module names that look MoE-ish, for the "nothing found" error.
    candidates: list[str] = field(default_factory=list)
    #: Blocks that train under plain ZeRO-3 (registered as ZeRO-3 leaf modules), with the reason.
    fallback: list[FallbackBlock] = field(default_factory=list)

    def summary(self, ep_enabled: bool = True) -> str:
        """One line: which blocks get EP and which do not, and why."""
        if not ep_enabled:
            paths = [b.path for b in self.blocks] + [b.path for b in self.fallback]
            return (f"{len(paths)} MoE block(s) train under ZeRO without expert parallelism (ep_size=1)"
                    + (f": {_abbrev(paths)}" if paths else ""))
        ep = f"{len(self.blocks)} MoE block(s) with expert parallelism"
        if self.blocks:
            ep += f" ({_abbrev([b.path for b in self.blocks])})"
        if not self.fallback:
            return ep
        reasons: dict[str, list[str]] = {}
        for block in self.fallback:
            reasons.setdefault(block.reason, []).append(block.path)
        rest = "; ".join(f"{_abbrev(paths)}: {reason}" for reason, paths in reasons.items())
        return f"{ep}; {len(self.fallback)} without EP ({rest})"

    def no_ep_warning(self, ep_size: int, leaves: list[str]) -> str | None:
        """The one warning for ``ep_size > 1`` when MoE blocks exist but none gets expert parallelism
        (every kind of model says it the same way), naming each block and its reason; None otherwise.

        ``leaves``: the block paths registered as ZeRO-3 leaf modules."""
        if ep_size <= 1 or self.blocks or not self.fallback:
            return None
        lines = "\n".join(f"  {b.path}{f' ({b.block_class})' if b.block_class else ''}: {b.reason}"
                          for b in self.fallback)
        leaf_note = (f"{len(leaves)} of them are registered as ZeRO-3 leaf modules (all of a block's experts are "
                     "gathered together, so ranks whose tokens pick different experts still issue the same "
                     "all-gathers)" if leaves else "none is registered as a ZeRO-3 leaf module (stage < 3)")
        return say(NO_EP_ENTRY, "no-block-converts", ep_size=ep_size, count=len(self.fallback), source=self.source,
                   leaf_note=leaf_note, reasons=lines)

    def without(self, failed: dict[str, str]) -> "Discovery":
        """A copy with the ``failed`` blocks (path -> reason) moved to the fallback, pattern narrowed."""
        if not failed:
            return self
        kept = [b for b in self.blocks if b.path not in failed]
        fallback = list(self.fallback) + [
            FallbackBlock(b.path, failed[b.path], b.layout.block_class if b.layout else "", b.layout)
            for b in self.blocks if b.path in failed]
        autoep = dict(self.autoep)
        if kept:
            autoep["moe_layer_pattern"] = exact_pattern(b.path for b in kept)
        else:
            autoep = {}
        return replace(self, blocks=kept, fallback=fallback, autoep=autoep)


def _abbrev(paths: list[str], limit: int = 4) -> str:
    """The first ``limit`` paths, and how many more."""
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def exact_pattern(paths: Any) -> str:
    """A ``re.fullmatch`` pattern matching exactly these module names."""
    return "|".join(re.escape(p) for p in paths)


def one_kind(convertible: list[tuple[BlockLayout, Routing]], fallback: list[FallbackBlock],
             num_experts_attr: str) -> tuple[list[MoEBlock], dict[str, Any]]:
    """AutoEP converts one block layout per engine: the most common kind among ``convertible`` is
    kept (its blocks and the ``expert_parallel`` keys locating them), the rest are appended to
    ``fallback`` with the reason."""
    signatures = Counter(_signature(lay, rt) for lay, rt in convertible)
    keep = signatures.most_common(1)[0][0] if signatures else None
    blocks: list[MoEBlock] = []
    for layout, routing in convertible:
        if _signature(layout, routing) == keep:
            blocks.append(MoEBlock(layout.path, layout.num_experts, routing.top_k, layout, routing))
        else:
            fallback.append(FallbackBlock(layout.path, "it differs in layout or routing from the model's other "
                                          "MoE blocks, and AutoEP converts one kind per model",
                                          layout.block_class, layout))
    if not blocks:
        return blocks, {}
    first, routing = blocks[0].layout, blocks[0].routing
    assert first is not None and routing is not None
    autoep = {"moe_layer_pattern": exact_pattern(b.path for b in blocks), "router_pattern": first.autoep_router,
              "expert_pattern": first.autoep_experts, "expert_w1": first.w1, "expert_w2": first.w2,
              "expert_w3": first.w3, "num_experts_attr": num_experts_attr, **routing.autoep_keys()}
    return blocks, autoep


def _signature(layout: BlockLayout, routing: Routing) -> tuple[Any, ...]:
    return (layout.autoep_router, layout.experts, layout.w1, layout.w2, layout.w3, layout.num_experts,
            layout.storage, routing)


#: A name AutoEP will not find on a config, so it takes the expert count from the router weight.
NUM_EXPERTS_FROM_ROUTER = "zeromoe_num_experts_from_router_weight"


def blocks_matching(root: nn.Module, regex: str, router: str, experts: str) -> list[tuple[str, nn.Module]]:
    """Modules whose name fully matches ``regex`` and that have ``router`` and ``experts`` children."""
    compiled = re.compile(regex)
    return [(name, m) for name, m in root.named_modules()
            if compiled.fullmatch(name) and hasattr(m, router) and hasattr(m, experts)]


def num_experts_of(block: nn.Module, router: str) -> int:
    """Rows of the router weight (``ds_shape`` for a ZeRO-3 partitioned one)."""
    weight = getattr(getattr(block, router), "weight")
    shape = getattr(weight, "ds_shape", weight.shape)
    return int(shape[0])


def config_holder(root: nn.Module, path: str) -> tuple[str, Any] | None:
    """The innermost module on the way to ``path`` (itself included) that carries an HF config."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        module = root.get_submodule(prefix) if prefix else root
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "model_type", None), str):
            return prefix, config
    return None


def prefix_pattern(path: str) -> str:
    """A regex for the module-name prefix ``path.`` (empty for the root)."""
    return re.escape(path + ".") if path else ""


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or whichever of the two is not empty."""
    return f"{prefix}.{name}" if prefix and name else prefix or name
