"""The peer's layout: transformers' native FSDP2 + expert parallelism, per GPU, at any scale.

What ``AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=W,
ep_size=E))`` builds in transformers 5.24, read from its code (``transformers/distributed/``), modelled
for ``tp_size = pp_size = dp_replicate_size = 1`` (so ``fsdp_size`` is the world size ``W``):

meshes (``utils.initialize_distributed_mesh``)
    a dense mesh ``(pp, dp_replicate, fsdp, tp)`` and an expert mesh ``(pp, dp_replicate, efsdp, ep)``
    with ``efsdp = fsdp * tp / ep`` (``DistributedConfig.efsdp_size``), both row-major over the same
    ranks: expert-parallel groups are ``ep`` consecutive ranks, expert-FSDP groups every ``ep``-th rank
    (the placement DeepSpeed gives its expert and expert-data-parallel groups, so the planner's link
    model applies unchanged). ``ep`` must divide ``W`` and the number of experts.
parameters (``expert_parallel.MoEParamShard``, ``fsdp.apply_fully_sharded_data_parallelism``)
    the model's ``ep_plan`` shards each expert tensor on dim 0 (the expert dim) over the ``ep`` group
    (``grouped_gemm`` rules); then ``fully_shard`` wraps each ``ep_dispatch_experts`` module (a layer's
    experts) on the ``efsdp`` mesh, and the ``fsdp_plan``'s modules on the ``fsdp`` mesh, innermost
    first: ``model.layers.*`` and ``model.embed_tokens`` with ``reshard_after_forward=True``
    (``free_full_weight``), the final norm and ``lm_head`` together with ``reshard_after_forward=False``
    (``keep_full_weight``), and the root last. FSDP2 shards every tensor on dim 0 in ``torch.chunk``
    pieces (``ceil(d0 / n)`` rows; the last ranks may hold fewer or none) and pads each rank's shard to
    ``ceil(d0 / n)`` rows in its buffers. At ``ep = 1`` the experts stay in their layer's unit.
mixed precision (``fsdp._get_fsdp_policy_kwargs``)
    ``fsdp_mixed_precision=True``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``,
    the only mixed precision offered (bf16; there is no fp16 policy). The sharded parameters keep the
    dtype they were loaded in (fp32 here), so the fp32 "master" weights *are* the parameters: per element
    4 (parameter) + 4 (gradient, fp32) + 8 (AdamW's two fp32 states) = 16 bytes, the same total as
    ZeRO's bf16 + fp32 master, held differently. Gathers move bf16, gradient reduce-scatters fp32.
    ``precision="fp32"``: no policy, fp32 everywhere.
communication, per micro-batch (FSDP2 reduces the gradients of every backward unless the loop turns
    gradient sync off)
    one all-gather per unit in forward and, for units that reshard after forward, one more in
    backward (activation checkpointing's recompute runs inside the backward's gather); one
    reduce-scatter per unit in backward; the full buffer of each is ``n * ceil(d0 / n) * rest`` elements
    per tensor. Token dispatch (``expert_parallel.AllToAllEP``), per MoE layer: an ``all_to_all_single``
    of the per-expert counts (int64: ``E * 8`` bytes), the dispatch and the combine in forward and their
    gradients in backward, ``T * k * h`` activations each on average, as AutoEP.
what the peer does not have
    ZeRO stages 1 and 2 (replicated parameters, partitioned optimizer states): FSDP2 always shards
    parameters, gradients and states. Its only offload, ``fsdp_cpu_offload=True``
    (``CPUOffloadPolicy``), moves parameters, gradients and optimizer states to the host together, and
    the optimizer then runs on the host.

Not modelled: HSDP (``dp_replicate_size``) and tensor parallelism (``tp_size``) of the peer, modules
kept in fp32 by a model's dtype plan (their own FSDP unit), gradient clipping's scalar all-reduces.

Pure module: no torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from lightning_zeromoe.planner.comm import kind_totals
from lightning_zeromoe.planner.links import bus_factor, group_size, ranks_per_node, spans_nodes
from lightning_zeromoe.planner.setups import normalize_precision
from lightning_zeromoe.planner.step_time import Hardware

#: The two native setups: FSDP2 keeps everything on the device, or offloads it all to the host.
NATIVE_SETUPS = ("FSDP2", "FSDP2 + CPU offload")


@dataclass(frozen=True)
class NativeTensor:
    """One trainable parameter tensor as the model names it, with its full (unsharded) shape."""

    name: str
    shape: tuple[int, ...]
    expert: bool

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_elements(self) -> int:
        out = 1
        for d in self.shape[1:]:
            out *= d
        return out


@dataclass(frozen=True)
class NativeUnit:
    """One ``fully_shard`` call: the module it wraps (``""``: the root), its tensors, whether it
    sits on the expert mesh (a layer's dispatched experts) and whether it reshards after forward."""

    name: str
    tensors: tuple[NativeTensor, ...]
    expert: bool
    reshard_after_forward: bool


@dataclass(frozen=True)
class NativeLayout:
    """The meshes for ``DistributedConfig(fsdp_size=world, ep_size=ep_size)``."""

    world: int
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or self.ep_size < 1 or self.world % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide fsdp_size * tp_size = {self.world} "
                             "(transformers' DistributedConfig refuses it)")

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them (``DistributedConfig.efsdp_size``)."""
        return self.world // self.ep_size

    def group(self, unit: NativeUnit) -> int:
        """Ranks one unit is sharded over."""
        return self.efsdp if unit.expert else self.world

    def rows_here(self, tensor: NativeTensor) -> int:
        """Rows of dim 0 before FSDP2 shards them: an expert tensor keeps its ``1 / ep_size`` share."""
        if tensor.expert and self.ep_size > 1:
            if tensor.rows % self.ep_size:
                raise ValueError(f"{tensor.name}: {tensor.rows} experts do not split over ep_size={self.ep_size}")
            return tensor.rows // self.ep_size
        return tensor.rows


def _generic(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: how transformers matches plan keys."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def fsdp_units(tensors: Iterable[NativeTensor], fsdp_plan: Mapping[str, str], ep_plan: Mapping[str, str],
               ep_size: int) -> tuple[NativeUnit, ...]:
    """The ``fully_shard`` units transformers builds from a model's plans (module docstring): each
    tensor goes to the innermost module named by the plans (``ep_dispatch_experts`` modules only when
    ``ep_size > 1``), else to the root; a final norm and the head, both ``keep_full_weight``, share one."""
    dispatch = {k for k, v in ep_plan.items() if v == "ep_dispatch_experts"} if ep_size > 1 else set()
    styles = {k: v for k, v in fsdp_plan.items()}
    groups: dict[str, list[NativeTensor]] = {}
    expert_of: dict[str, bool] = {}
    for t in tensors:
        parts = t.name.split(".")[:-1]
        owner, is_expert = "", False
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            generic = _generic(module)
            if generic in dispatch:
                owner, is_expert = module, True
                break
            if generic in styles or module in styles:
                owner = module
                break
        groups.setdefault(owner, []).append(t)
        expert_of[owner] = is_expert
    keep = [m for m in groups if m and styles.get(_generic(m), styles.get(m)) == "keep_full_weight"]
    if len(keep) == 2 and any(m == "norm" or m.endswith(".norm") for m in keep):
        first, second = keep
        groups[first + "+" + second] = groups.pop(first) + groups.pop(second)
        expert_of[first + "+" + second] = False
        keep = [first + "+" + second]
    units = []
    for module, members in groups.items():
        reshard = bool(module) and module not in keep
        units.append(NativeUnit(module, tuple(members), expert_of[module], reshard))
    return tuple(units)


def local_rows(rows: int, group: int, index: int) -> int:
    """Rows of dim 0 the ``index``-th rank of a group of ``group`` holds: ``torch.chunk``'s pieces."""
    step = -(-rows // group)
    return max(0, min(step, rows - index * step))


def local_elements(unit: NativeUnit, layout: NativeLayout, rank: int) -> int:
    """Elements of ``unit`` that ``rank`` holds (its DTensors' local shapes): dense units are
    chunked over all ranks, expert units over the rank's expert-FSDP group, where it is the
    ``rank // ep_size``-th."""
    group = layout.group(unit)
    index = rank // layout.ep_size if unit.expert else rank
    return sum(local_rows(layout.rows_here(t), group, index) * t.row_elements for t in unit.tensors)


def padded_elements(unit: NativeUnit, layout: NativeLayout) -> int:
    """Elements of ``unit``'s padded shard on every rank: ``ceil(rows / group)`` rows per tensor."""
    group = layout.group(unit)
    return sum(-(-layout.rows_here(t) // group) * t.row_elements for t in unit.tensors)


def unsharded_elements(unit: NativeUnit, layout: NativeLayout) -> int:
    """Elements of ``unit`` while it is gathered on one rank: whole dense tensors, the rank's
    ``1 / ep_size`` share of the experts."""
    return sum(layout.rows_here(t) * t.row_elements for t in unit.tensors)


def _layer_of(module: str) -> str:
    """The decoder layer a unit belongs to (``model.layers.3.mlp.experts`` -> ``model.layers.3``)."""
    found = re.match(r"(.*?\.(?:layers|layer|h|blocks)\.\d+)(?:\.|$)", module)
    return found.group(1) if found else module


def gathered_elements(unit: NativeUnit, layout: NativeLayout) -> int:
    """Elements of one all-gather (or reduce-scatter) buffer of ``unit``: the padded shard times the group."""
    return padded_elements(unit, layout) * layout.group(unit)


# --------------------------------------------------------------------------------- precision

@dataclass(frozen=True)
class NativePrecision:
    """Bytes per element of what FSDP2 keeps (parameter, gradient), gathers and reduces."""

    stored: int
    gathered: int
    reduced: int

    @classmethod
    def of(cls, precision: str) -> "NativePrecision":
        p = normalize_precision(precision)
        if p == "fp16":
            raise ValueError("transformers' FSDP2 offers bf16 mixed precision only (fsdp_mixed_precision=True); "
                             "plan the peer with precision='bf16' or 'fp32'")
        return cls(4, 2, 4) if p == "bf16" else cls(4, 4, 4)


# --------------------------------------------------------------------------------- memory

@dataclass(frozen=True)
class NativeStates:
    """Bytes per GPU under the peer's layout (``offload``: ``fsdp_cpu_offload=True``)."""

    setup: str
    params: float
    grads: float
    optimizer: float
    host: float
    dense: float
    expert: float
    #: Unsharded parameters and gradients live during a step: two layers' units gathered (the one
    #: computing and the one prefetched), the kept norm and head, and one layer's full gradients.
    gathered: float
    #: What torch's AdamW adds while it runs on the device (``adam.py::_multi_tensor_adam``, the foreach
    #: path on GPUs: ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``): one fp32 copy of the shard.
    step_scratch: float = 0.0

    @property
    def device_total(self) -> float:
        return self.params + self.grads + self.optimizer

    def peak(self, activations: float = 0.0) -> float:
        """The larger of backward (states, ``activations`` and the gathered units) and the optimizer
        update (states and AdamW's temporary); the peak of the peer's step, modelled, not measured."""
        return self.device_total + max(self.gathered + activations, self.step_scratch)


def native_states(units: tuple[NativeUnit, ...], layout: NativeLayout, precision: str = "bf16", *,
                  optimizer_bytes: int = 8, offload: bool = False) -> NativeStates:
    """Per-GPU model states of the peer (module docstring), from the padded shards FSDP2 allocates."""
    bytes_ = NativePrecision.of(precision)
    dense = sum(padded_elements(u, layout) for u in units if not u.expert)
    expert = sum(padded_elements(u, layout) for u in units if u.expert)
    per = 2 * bytes_.stored + optimizer_bytes
    held = dense + expert
    params, grads, opt = held * bytes_.stored, held * bytes_.stored, held * optimizer_bytes
    host = 0.0
    if offload:
        host, params, grads, opt = params + grads + opt, 0.0, 0.0, 0.0
    per_layer: dict[str, int] = {}
    for u in units:
        if u.reshard_after_forward:
            layer = _layer_of(u.name)
            per_layer[layer] = per_layer.get(layer, 0) + unsharded_elements(u, layout)
    largest = max(per_layer.values(), default=0)
    kept = sum(unsharded_elements(u, layout) for u in units if u.name and not u.reshard_after_forward)
    gathered = 2 * largest * bytes_.gathered + kept * bytes_.gathered + largest * (bytes_.gathered + bytes_.reduced)
    scratch = 0.0 if offload else held * 4.0
    return NativeStates(setup=NATIVE_SETUPS[1] if offload else NATIVE_SETUPS[0], params=params, grads=grads,
                        optimizer=opt, host=host, dense=dense * per, expert=expert * per, gathered=gathered,
                        step_scratch=scratch)


# --------------------------------------------------------------------------------- communication

@dataclass(frozen=True)
class NativeComm:
    """Bytes (the ``nccl-tests`` full buffer, per rank) and calls per optimizer step, by (collective,
    group); groups are named as DeepSpeed's that sit on the same ranks (``world`` = fsdp,
    ``expert_data_parallel`` = efsdp, ``expert_parallel`` = ep)."""

    bytes: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    kinds: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def by_kind(self) -> dict[str, float]:
        return kind_totals(self.bytes, self.kinds)

    def _add(self, collective: str, group: str, nbytes: float, calls: int, kind: str) -> None:
        if nbytes <= 0:
            return
        key = (collective, group)
        self.bytes[key] = self.bytes.get(key, 0.0) + nbytes
        self.calls[key] = self.calls.get(key, 0) + calls
        self.kinds.setdefault(key, kind)


@dataclass(frozen=True)
class NativeTraffic:
    """What the token dispatch depends on (0 tokens: parameters and gradients only)."""

    tokens_per_micro_batch: int = 0
    top_k: int = 2
    hidden_size: int = 0
    moe_layers: int = 0
    num_experts: int = 0
    accumulation: int = 1
    activation_checkpointing: bool = False


def native_comm(units: tuple[NativeUnit, ...], layout: NativeLayout, precision: str = "bf16",
                traffic: NativeTraffic = NativeTraffic()) -> NativeComm:
    """Bytes and calls per optimizer step of the peer (module docstring)."""
    bytes_ = NativePrecision.of(precision)
    out = NativeComm()
    A = traffic.accumulation
    for u in units:
        n = layout.group(u)
        if n <= 1:
            continue
        group = "expert_data_parallel" if u.expert else "world"
        buffer = gathered_elements(u, layout)
        gathers = 2 if u.reshard_after_forward else 1
        out._add("all_gather", group, A * gathers * buffer * bytes_.gathered, A * gathers, "params")
        out._add("reduce_scatter", group, A * buffer * bytes_.reduced, A, "grads")
    if layout.ep_size > 1 and traffic.moe_layers and traffic.tokens_per_micro_batch:
        forwards = 2 if traffic.activation_checkpointing else 1
        rows = traffic.tokens_per_micro_batch * traffic.top_k * traffic.hidden_size * bytes_.gathered
        per_layer = (2 * forwards + 2) * rows + forwards * traffic.num_experts * 8
        out._add("all_to_all", "expert_parallel", A * traffic.moe_layers * per_layer,
                 A * traffic.moe_layers * (3 * forwards + 2), "all_to_all")
    return out


def comm_seconds(comm: NativeComm, layout: NativeLayout, hardware: Hardware, gpus_per_node: int) -> float:
    """Seconds of ``comm`` on ``hardware``'s links (:class:`~lightning_zeromoe.planner.step_time.Hardware`),
    the way the step-time model times ZeRO's collectives: bytes x bus factor / bandwidth + calls x latency."""
    total = 0.0
    for (collective, group), nbytes in comm.bytes.items():
        n = group_size(group, layout.world, layout.ep_size)
        link = hardware.link(collective, spans_nodes(group, layout.world, layout.ep_size, gpus_per_node), n,
                             ranks_per_node(group, layout.world, layout.ep_size, gpus_per_node))
        total += nbytes * bus_factor(collective, n) / link.bandwidth + comm.calls[(collective, group)] * link.latency
    return total


@dataclass(frozen=True)
class NativeStepTime:
    """Predicted seconds of one optimizer step of the peer, by term (a serial sum, as for ZeRO)."""

    compute: float
    comm: float
    offload: float
    #: FSDP2's hooks, per unit and pass, at the per-pass cost the ZeRO-3 term assumes per module.
    host: float

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.offload + self.host


def native_step_time(units: tuple[NativeUnit, ...], layout: NativeLayout, comm: NativeComm, hardware: Hardware, *,
                     flops: float, gpus_per_node: int, precision: str = "bf16", accumulation: int = 1,
                     offload: bool = False) -> NativeStepTime:
    """The step-time model's terms for the peer (:mod:`~lightning_zeromoe.planner.step_time`, same
    :class:`Hardware`): ``flops`` of the rank's tokens, the optimizer update over its shard (on the
    device, or CPU AdamW with ``offload``, which also copies every gathered shard to the device and every
    reduced gradient shard back over PCIe), ``comm`` on the links, and the hooks of each unit, forward
    and backward, every micro-batch."""
    hw = hardware
    elements = sum(padded_elements(u, layout) for u in units)
    compute = flops / hw.flops_per_second
    moved = 0.0
    if offload:
        stored = NativePrecision.of(precision).stored
        moved = accumulation * sum(padded_elements(u, layout) * stored * (3 if u.reshard_after_forward else 2)
                                   for u in units)
        extra = moved / hw.pcie_bandwidth + elements / hw.cpu_adam_params_per_second
    else:
        compute += elements / hw.update_params_per_second
        extra = 0.0
    host = 2 * accumulation * len(units) * hw.zero3_module_seconds
    return NativeStepTime(compute=compute, comm=comm_seconds(comm, layout, hw, gpus_per_node), offload=extra,
                          host=host)


__all__ = ["NATIVE_SETUPS", "NativeComm", "NativeLayout", "NativePrecision", "NativeStates", "NativeStepTime",
           "NativeTensor", "NativeTraffic", "NativeUnit", "comm_seconds", "fsdp_units", "gathered_elements",
           "local_elements", "local_rows", "native_comm", "native_states", "native_step_time", "padded_elements",
           "unsharded_elements"]
