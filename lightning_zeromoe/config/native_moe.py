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

Pure: module paths and sizes in, a size and an info line out (or a ``ZeroMoEConfigError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from lightning_zeromoe.discovery.find import native_moe_paths
from lightning_zeromoe.config.validation import ZeroMoEConfigError, divisors

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
        raise ZeroMoEConfigError(
            f"[{ENTRY}] the model's native deepspeed.moe.layer.MoE modules were built with different ep_size values "
            f"({by_size}); ZeroMoEStrategy trains one expert-parallel size. Build every MoE layer with the same "
            "MoE(..., ep_size=N).")
    built = distinct[0]
    section = user_expert_parallel or {}
    if section and section.get("enabled") is not False:
        raise ZeroMoEConfigError(
            f"[{ENTRY}] your DeepSpeed config has an expert_parallel (AutoEP) section, but the model's "
            f"{len(sizes)} native deepspeed.moe.layer.MoE module(s) ({_where(sizes)}) were built with ep_size={built} "
            "and set their expert parallelism themselves; AutoEP converts plain MoE blocks, not these. Remove "
            f"expert_parallel from the config (and pass ZeroMoEStrategy(ep_size={built}) or leave ep_size unset).")
    if asked is not None and asked != built:
        raise ZeroMoEConfigError(
            f"[{ENTRY}] ZeroMoEStrategy(ep_size={asked}), but the model's {len(sizes)} native deepspeed.moe.layer.MoE "
            f"module(s) ({_where(sizes)}) were built with ep_size={built}, which the strategy cannot change. Pass "
            f"ZeroMoEStrategy(ep_size={built}) or leave ep_size unset, or build the layers with MoE(..., ep_size={asked}).")
    if world_size % built:
        raise ZeroMoEConfigError(
            f"[ep-size-divisibility] the model's native deepspeed.moe.layer.MoE module(s) ({_where(sizes)}) were built "
            f"with ep_size={built}, which does not divide the world size {world_size} (devices x num_nodes): the "
            f"expert groups of ep_size ranks must tile the world. Build them with MoE(..., ep_size=N) for N in "
            f"{divisors(world_size)}, or change devices/num_nodes.")
    note = None
    if asked is None:
        note = (f"ZeroMoEStrategy: ep_size={built}, from the model's {len(sizes)} native deepspeed.moe.layer.MoE "
                f"module(s) ({_where(sizes)}); their expert groups come from the modules, no AutoEP section is written.")
    return NativeEP(built, note)
