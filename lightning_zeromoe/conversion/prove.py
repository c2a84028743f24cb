"""Before AutoEP converts: prove each conversion, keep the blocks that pass, and say what happened.

:func:`prove` probes every block AutoEP would convert (:mod:`lightning_zeromoe.conversion.check`),
narrows the ``expert_parallel`` section to the blocks that compute what the original does, marks
the rest as ZeRO-3 leaf modules, and returns the lines to log: the same rule and words for every
kind of model. :func:`after_conversion` restores what AutoEP's layer does not return by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.nn import Module

from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.conversion.check import (check_conversion, match_output_contract, narrowed_config,
                                                probe_summary, register_fallback_leaves, restore_router_logits)
from lightning_zeromoe.discovery.find import Discovery


@dataclass
class Proof:
    """What :func:`prove` decided: the config DeepSpeed gets and what to tell the user."""

    config: DeepSpeedConfig
    #: Discovery with the blocks that failed their probe moved to the fallbacks.
    found: Discovery
    #: Whether AutoEP converts any block.
    converts: bool
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def prove(module: Module, found: Discovery, config: DeepSpeedConfig, *, ep_size: int, on_cpu: bool,
          zero_stage_3: bool) -> Proof:
    """Probe, narrow and register leaves (collective under ZeRO-3: every rank calls it)."""
    warnings: list[str] = []
    notes: list[str] = []
    ep_section = config.expert_parallel
    # AutoEP converts: expert parallelism, or grouped_experts at ep_size=1 (ResolvedConfig.expert_parallel).
    converts = bool(found.blocks) and config.converts_blocks
    if converts and ep_section is not None:
        section = dict(found.autoep)
        found, checks = check_conversion(module, found, section=ep_section.to_dict())  # AutoEP's parser reads a dict
        warnings += [check.message(section) for check in checks if not check.passed]
        notes.append(probe_summary(checks, grouped_configured=bool(ep_section.use_grouped_mm), on_cpu=on_cpu))
        converts = bool(found.blocks)
    # Also when nothing is probed (every block fell back at fit, and validate builds the evaluation
    # engine from the full config again): AutoEP converts only the blocks that passed.
    config = narrowed_config(config, found)
    leaves = register_fallback_leaves(module, found, ep_converts=converts) if zero_stage_3 else []
    if found.blocks or found.fallback:
        leaf_note = f"; {len(leaves)} registered as ZeRO-3 leaf modules" if leaves else ""
        notes.append(f"ZeroMoEStrategy: {found.summary(ep_enabled=ep_size > 1)}{leaf_note}")
    no_ep = found.no_ep_warning(ep_size, leaves)
    if no_ep:
        warnings.append(no_ep)
    return Proof(config=config, found=found, converts=converts, warnings=warnings, notes=notes)


def after_conversion(module: Module, found: Discovery) -> None:
    """After ``deepspeed.initialize`` converted: router logits recorded again, and hand-written
    ``(hidden, router_logits)`` blocks get the tuple back."""
    restore_router_logits(module, found)
    for block in found.blocks:
        match_output_contract(module.get_submodule(block.path), block.returns_tuple)


__all__ = ["Proof", "after_conversion", "prove"]
