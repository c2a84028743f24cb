"""Expert parallelism for DeepSpeed's native ``deepspeed.moe.layer.MoE``: set in the modules.

A native MoE layer fixes its expert-parallel size when it is built (``MoE(..., ep_size=N)``): it
keeps ``num_experts / N`` experts, tags their parameters with the group name ``ep_size_<N>``, and
``deepspeed.initialize`` creates that expert group from the layer (``set_deepspeed_parallelism``,
deepspeed 0.19.8 ``moe/layer.py``). The strategy's ``ep_size`` cannot change it, and the strategy
never writes an AutoEP ``expert_parallel`` section for such a model (AutoEP converts plain blocks,
not native layers). So the strategy's ``ep_size`` must be the modules' one, or left unset:

* ``ep_size`` unset (``None``): the modules' ``ep_size`` is used, and said once in the log;
* ``ep_size`` equal to the modules': used;
* anything else is refused before any process group exists, with one line naming both sizes:
  a different ``ep_size``, layers built with different sizes, an ``expert_parallel`` section in
  the user's config, or a size that does not divide the world.

``stage="auto"`` plans with the layers' own size and never answers stage 3, which DeepSpeed refuses
for native layers (:func:`native_auto_stage`); a model that also holds blocks AutoEP would convert
is refused (:func:`check_one_kind`).

Pure: module paths and sizes in, a size and an info line out (or a ``ZeroMoEConfigError``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from lightning_zeromoe.discovery.find import Discovery, native_moe_paths
from lightning_zeromoe.config.validation import ZeroMoEConfigError, divisors
from lightning_zeromoe.knowledge import compose, say
from lightning_zeromoe.planner.counts import ParamCounts, count_params

ENTRY = "native-moe-ep-size"


def native_ep_sizes(root: nn.Module) -> dict[str, int]:
    """Each native MoE module's path and the ``ep_size`` it was built with (what discovery records)."""
    return {path: int(getattr(root.get_submodule(path), "ep_size", 1)) for path in native_moe_paths(root)}


@dataclass(frozen=True)
class NativeEP:
    """The expert-parallel size a model of native MoE layers trains with, and why."""

    ep_size: int
    #: The info line when the size was taken from the modules (``ep_size`` left unset); else None.
    note: str | None = None


def _where(sizes: Mapping[str, int]) -> str:
    paths = list(sizes)
    return f"'{paths[0]}'" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")


def native_ep(sizes: Mapping[str, int], *, asked: int | None, world_size: int,
              user_expert_parallel: Mapping[str, Any] | None = None) -> NativeEP | None:
    """The expert-parallel size for a model whose MoE layers are native; None when it has none.

    ``asked``: the strategy's ``ep_size`` (None: left unset). ``user_expert_parallel``: the
    ``expert_parallel`` section of the user's DeepSpeed config, if any.
    """
    if not sizes:
        return None
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        by_size = "; ".join(f"ep_size={s}: {_where({p: v for p, v in sizes.items() if v == s})}" for s in distinct)
        raise ZeroMoEConfigError(say(ENTRY, "mixed-sizes", "same-size-every-layer", by_size=by_size))
    built = distinct[0]
    section = user_expert_parallel or {}
    if section and section.get("enabled") is not False:
        raise ZeroMoEConfigError(say(ENTRY, "autoep-section", "drop-expert-parallel-for-native", "match-layers-ep-size",
                                     count=len(sizes), where=_where(sizes), built=built))
    if asked is not None and asked != built:
        raise ZeroMoEConfigError(say(ENTRY, "mismatch", "match-layers-ep-size", "rebuild-layers-ep-size", asked=asked,
                                     count=len(sizes), where=_where(sizes), built=built))
    if world_size % built:
        raise ZeroMoEConfigError(say("ep-size-divisibility", "native-world-size", "rebuild-native-divisor",
                                     where=_where(sizes), built=built, world_size=world_size, valid=divisors(world_size)))
    note = None
    if asked is None:
        note = compose(ENTRY, "taken-from-layers", built=built, count=len(sizes), where=_where(sizes))
    return NativeEP(built, note)


def native_plan_counts(root: nn.Module, ep_size: int) -> ParamCounts:
    """The memory planner's parameter counts for a model of native layers built with ``ep_size``.

    Such a layer holds ``num_experts / ep_size`` experts on each rank, while :class:`ParamCounts`
    holds a layer's whole experts (the planner splits them by ``ep_size``, as AutoEP does): each
    expert tensor is counted ``ep_size`` times, so the planner's share per rank is the layer's own.
    """
    counts = count_params(root)
    return dataclasses.replace(counts, expert=tuple(n * ep_size for n in counts.expert))


def native_auto_stage(native: NativeEP, sizes: Mapping[str, int],
                      choose_stage: Callable[..., tuple[int, str]]) -> tuple[int, str]:
    """``stage="auto"`` for a model of native layers: the planner's stage, which must be 1 or 2.

    DeepSpeed refuses native layers under ZeRO stage 3, so when the planner finds that only stage 3
    (or offload) fits, the run is refused here, before any process group, rather than failing later
    (out of memory at stage 2, or DeepSpeed's refusal at stage 3). ``choose_stage(ep_size, native=True)``
    plans with the layers' own ``ep_size`` and :func:`native_plan_counts`.
    """
    stage, reason = choose_stage(native.ep_size, native=True)
    if stage == 3:
        raise ZeroMoEConfigError(say("native-moe-zero3", "auto-no-fit", "native-auto-no-fit", count=len(sizes),
                                     where=_where(sizes), built=native.ep_size, reason=reason))
    return stage, reason


def check_one_kind(found: Discovery, ep_size: int, converts: bool) -> None:
    """Refuse a model that holds native layers and blocks AutoEP would convert (``converts``: the run is
    expert-parallel or asks for AutoEP's layer): no AutoEP section is written beside native layers,
    so the blocks would silently train unconverted."""
    if found.native_moe and found.blocks and converts:
        paths = [b.path for b in found.blocks]
        first = f"'{paths[0]}'" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")
        raise ZeroMoEConfigError(say("native-moe-mixed-blocks", "both-kinds", "one-kind", count=len(found.native_moe),
                                     where=_where(found.native_ep_sizes), built=ep_size, blocks=len(paths),
                                     first=first, source=found.source))
