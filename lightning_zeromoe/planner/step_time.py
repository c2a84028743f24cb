"""Step-time model: how long one optimizer step takes per setup, to rank setups by time.

A prediction, built from terms that are added (no overlap assumed, see below):

compute
    ``flops_per_token * tokens per rank per step / Hardware.flops_per_second``. FLOPs per token
    (forward + backward) follow the usual form (Kaplan et al. 2020, "Scaling Laws for Neural
    Language Models", section 2.1; attention term as in Chowdhery et al. 2022, "PaLM",
    appendix B): ``6 * N_active + 12 * L * h * s``, where ``N_active = dense + expert * top_k / E``
    (each token runs ``top_k`` of the ``E`` experts), ``L`` the attention layers, ``h`` the
    attention width (heads x head size; the hidden size when not given) and ``s`` the sequence
    length. ``N_active`` counts every dense parameter, the embedding table too (a lookup, no
    matmul): a slight over-count that is the same for every setup. The attention term counts the
    full ``s x s`` score matrix, as the standard form does; causal kernels skip about half of it.
    Activation checkpointing repeats the forward: ``8`` instead of ``6`` (and 16 instead of 12).
    Expert parallelism does not change FLOPs per token: on average a rank computes what it would
    compute without it (balanced routing assumed). The optimizer update adds
    ``partitioned elements / Hardware.update_params_per_second``.

communication
    Bytes per collective and group from :mod:`lightning_zeromoe.planner.comm` (the ``nccl-tests``
    convention: the full buffer of a call), turned into seconds the ``nccl-tests`` way: bus
    bandwidth ``busbw = algbw * factor`` with ``factor = 2(n-1)/n`` for all-reduce, ``(n-1)/n`` for
    all-gather, reduce-scatter and all-to-all, ``1`` for broadcast (``n``: ranks in the group), so
    ``time = bytes * factor / bandwidth + calls * latency``. A group whose ranks sit on more than
    one node uses :attr:`Hardware.inter` per NIC: a ring collective of a group with ``k`` ranks on each
    node runs over their ``k`` NICs (``k x inter``, at most ``intra``; the all-to-all over each rank's
    own: :func:`~lightning_zeromoe.planner.links.spanning_link`); a group inside one node uses
    :attr:`Hardware.intra`. Ratios between setups are checked against published H100/B200 runs
    (``tests/test_published_step_times.py``). Ranks are placed as
    DeepSpeed places them: expert-parallel groups are ``ep_size`` consecutive ranks, expert-data-
    parallel groups every ``ep_size``-th rank, the world group all ranks. ``calls`` follows DeepSpeed's
    code and equals the ledger's count on CPU ranks (``tests/test_comm_ledger.py``): stages 1/2 one
    all-reduce per reduce bucket plus one norm per flat group, one all-gather per flat group; ZeRO-3
    one coalesced gather per ``stage3_prefetch_bucket_size`` elements of a pass (at most one per
    module; one per module on the first micro-batch, which records the trace) and one reduction per
    bucket and per change of group in backward order; AutoEP's per-layer all-to-alls
    (:func:`lightning_zeromoe.planner.calls.calls_per_step`).

offload (``offload_optimizer``)
    PCIe traffic: each rank copies its gradient partition to the host (stages 1/2: fp32, 4 bytes;
    stage 3: the gradient dtype) and its updated 16-bit parameter partition back, at
    :attr:`Hardware.pcie_bandwidth`; the update runs on the host at
    :attr:`Hardware.cpu_adam_params_per_second` instead of on the device. ``offload_parameters``
    adds the host-to-device copy of every parameter partition ZeRO-3 gathers. Modelled from
    DeepSpeed's design, not measured (this project's test machines have no GPU to offload from).

the expert loop
    A block that runs its experts one at a time pays for it twice, whatever the experts' FLOPs:
    - a fixed host cost per expert: the token selection and the launches of its small matmuls,
      forward and backward (:attr:`Hardware.expert_loop_seconds`);
    - where the loop slices fused 3-D expert tensors (``weight[e]``: transformers' ``"eager"``
      experts, AutoEP's layer with ``use_grouped_mm=False``), backward materialises a *full-size*
      gradient for every slice (torch's ``select_backward`` allocates zeros of the whole tensor and
      copies the slice in; autograd then adds it into the tensor's gradient): about 4 passes over
      the layer's local expert tensors per expert, so a cost quadratic in the local experts, at
      :attr:`Hardware.memory_bandwidth`.

    ``micro-batches * moe_layers * looped * (expert_loop_seconds + [slices] 4 * local expert bytes /
    memory_bandwidth)``, with ``looped`` each rank's own experts: ``num_experts`` at ``ep_size=1``,
    ``num_experts / ep_size`` with AutoEP, and the local expert bytes of one layer in the gradient's
    dtype. Expert parallelism thus cuts this term by ``ep_size`` (modules) or ``ep_size**2``
    (slices). Counted per :attr:`ModelShape.expert_loop` (the model's blocks, ``ep_size=1``) and
    :attr:`ModelShape.autoep_expert_loop` (AutoEP's layer); both default to ``"grouped"``, no loop:
    transformers 5 runs its MoE experts as grouped GEMMs where it can, and the strategy turns on
    AutoEP's grouped GEMM in bf16 on GPUs. On CPU ranks both rates are measured
    (``benchmarks/rank_setups.py --calibrate``: the same model with 8, 4 and 2 experts on one rank).

gradient staging
    Every gradient reduction first stages the rank's full gradients (its dense parameters and its own
    experts) in memory: ZeRO-1/2 copy them into the reduce bucket (``contiguous_gradients``), flatten
    each bucket for its all-reduce and copy the rank's partition out
    (``stage_1_and_2.py::average_tensor``, ``allreduce_bucket``); ZeRO-3 copies them into its bucket
    before the reduce-scatter. ``reductions * gradient bytes of the rank /
    Hardware.gradient_staging_bandwidth``, with one reduction per step at stage 1 and one per
    micro-batch at stages 2 and 3. On CPU ranks the rate is measured (``benchmarks/rank_setups.py
    --calibrate``: stage 2 minus stage 1 on one rank, where neither communicates; fresh flat buffers
    cost page faults there, so it is far below a copy's bandwidth); the GPU default is an assumption.

ZeRO-3's host-side work
    ZeRO-3 runs hooks and its parameter coordinator (fetch, release, trace bookkeeping) for every
    module with parameters, in forward and in backward, whether or not a gather is needed:
    ``2 * modules * micro-batches * Hardware.zero3_module_seconds``. On CPU ranks this is measured
    (``benchmarks/rank_setups.py --calibrate``: stage 3 minus stage 1 on one rank, where neither
    communicates, per module pass); the GPU default is an assumption, see the field.

Overlap assumption: none. ``total = compute + communication + offload + expert loop + gradient
staging + ZeRO-3 host``
is the serial sum, an upper bound. On GPUs ``overlap_comm`` hides part of the gradient reductions
behind backward, so absolute figures are pessimistic there; :attr:`Hardware.overlap` (0..1)
subtracts that fraction of the gradient-reduction time, at most the backward compute (2/3 of
compute), if you want to model it.

Pure module: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_zeromoe.planner.calls import calls_per_step
from lightning_zeromoe.planner.comm import CommPrediction, CommShape, predict
from lightning_zeromoe.planner.links import (INFINIBAND, NVLINK, Link, bus_factor, group_ranks, group_size,
                                             ranks_per_node, spanning_link, spans_nodes)
from lightning_zeromoe.planner.setups import _PRECISION_BYTES, Setup, normalize_precision


@dataclass(frozen=True)
class Hardware:
    """What the step-time model needs to know about the machines. Every field can be overridden;
    the defaults are H100/H200-class (sources in the comments)."""

    #: Achieved FLOP/s per device: ~40% of the 989 TFLOP/s dense bf16 peak of an H100/H200 SXM
    #: (NVIDIA datasheets), a typical model-FLOPs utilisation for MoE training.
    flops_per_second: float = 400e12
    intra: Link = NVLINK
    inter: Link = INFINIBAND
    #: Optimizer updates per second on the device: AdamW reads and writes ~36 bytes per element
    #: (fp32 master, two moments, gradient, 16-bit weight) against H200's 4.8 TB/s HBM.
    update_params_per_second: float = 1.0e11
    #: PCIe Gen5 x16: 64 GB/s per direction in theory, ~50 GB/s achieved with pinned memory.
    pcie_bandwidth: float = 50e9
    #: DeepSpeed's CPU Adam, per GPU's share of the host: an assumption (not measured here), from
    #: memory traffic: ~28 bytes read and written per element against ~30 GB/s of host memory
    #: bandwidth per GPU's share of a two-socket server.
    cpu_adam_params_per_second: float = 1.0e9
    #: ZeRO-3's host work per module with parameters and pass (forward or backward): hooks, fetch and
    #: release bookkeeping. An assumption for GPUs (not measured here): tens of microseconds of Python
    #: per module pass. On CPU ranks measured by ``benchmarks/rank_setups.py --calibrate``.
    zero3_module_seconds: float = 50e-6
    #: Host cost of one expert run on its own, forward and backward, in a block that loops over its
    #: experts (see :attr:`ModelShape.expert_loop`): token selection and the launches of ~30 small
    #: kernels at a few microseconds each. An assumption for GPUs (not measured here); on CPU ranks
    #: measured by ``benchmarks/rank_setups.py --calibrate``.
    expert_loop_seconds: float = 100e-6
    #: Achieved device memory bandwidth, bytes/s, for the full-size gradients of a sliced expert
    #: loop: ~80% of H200's 4.8 TB/s HBM3e (NVIDIA datasheet). On CPU ranks an effective rate fitted
    #: by ``benchmarks/rank_setups.py --calibrate``.
    memory_bandwidth: float = 4.0e12
    #: Bytes of gradient per second through a reduction's staging (see the module docstring,
    #: "gradient staging"): an assumption for GPUs, about 4 bytes of HBM traffic per gradient byte
    #: (the bucket copy, the flatten, the partition copy) at ``memory_bandwidth``. On CPU ranks
    #: measured by ``benchmarks/rank_setups.py --calibrate``.
    gradient_staging_bandwidth: float = 1.0e12
    #: Fraction (0..1) of gradient-reduction time hidden behind backward; 0 = serial sum.
    overlap: float = 0.0
    #: Links measured per collective (``"all_reduce"``, ``"all_gather"``, ...), or per collective and
    #: group size (``"all_to_all/2"``, preferred when present), used instead of ``intra`` for groups
    #: inside one node: for a backend whose collectives differ (gloo on CPU).
    collective_links: tuple[tuple[str, Link], ...] = ()

    def link(self, collective: str, spans_nodes: bool, ranks: int = 0, per_node: int = 1) -> Link:
        """The link of a collective on a group of ``ranks`` ranks; across nodes, with ``per_node`` of
        them on each node (:func:`~lightning_zeromoe.planner.links.spanning_link`)."""
        if spans_nodes:
            return spanning_link(collective, per_node, self.intra, self.inter)
        links = dict(self.collective_links)
        return links.get(f"{collective}/{ranks}", links.get(collective, self.intra))


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on one rank, by term."""

    compute: float
    #: (collective, group) -> seconds (bandwidth term + latency term).
    comm: dict[tuple[str, str], float]
    offload: float
    total: float
    #: ZeRO-3's host-side work (hooks, fetch/release bookkeeping), seconds.
    zero3_host: float
    flops_per_rank: float
    comm_bytes: float
    #: Host cost of the experts run one at a time (0 when the experts run as grouped GEMMs), seconds.
    expert_loop: float = 0.0
    #: The rank's gradients staged for their reductions (bucket copies, flattening), seconds.
    gradient_staging: float = 0.0
    #: (collective, group) -> (calls per step, ranks in the group, whether it spans nodes).
    groups: dict[tuple[str, str], tuple[int, int, bool]] = field(default_factory=dict)
    overlap: str = ("none: total = compute + communication + offload + expert loop + gradient staging + ZeRO-3 "
                    "host work (serial sum)")

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())

    def describe(self) -> str:
        """``1.23 s (compute 800.0 ms, comm 400.0 ms, gradient staging 30.0 ms)``: the total and its
        parts (compute and comm always, the others where they are not zero)."""
        parts = [("compute", self.compute), ("comm", self.comm_total), ("offload", self.offload),
                 ("expert loop", self.expert_loop), ("gradient staging", self.gradient_staging),
                 ("ZeRO-3 host work", self.zero3_host)]
        shown = [f"{name} {format_seconds(value)}" for i, (name, value) in enumerate(parts) if i < 2 or value]
        return f"{format_seconds(self.total)} ({', '.join(shown)})"


@dataclass(frozen=True)
class ModelShape:
    """What compute needs beyond :class:`~lightning_zeromoe.planner.comm.CommShape`."""

    attention_layers: int = 0
    seq_len: int = 0
    #: Attention width (heads x head size); 0: the hidden size.
    attention_width: int = 0
    #: How the model's own MoE blocks run their experts (at ``ep_size=1``, where nothing converts
    #: them): ``"grouped"`` (grouped GEMMs: transformers 5's default where it can dispatch them),
    #: ``"modules"`` (a loop over a ``ModuleList`` of expert modules) or ``"slices"`` (a loop over
    #: slices of fused 3-D expert tensors: transformers' ``experts_implementation="eager"``).
    expert_loop: str = "grouped"
    #: The same for AutoEP's layer (``ep_size > 1``): ``"grouped"`` in bf16 on GPUs, where the
    #: strategy turns on its grouped GEMM; ``"slices"`` otherwise (its per-expert loop).
    autoep_expert_loop: str = "grouped"

    def __post_init__(self) -> None:
        for name in ("expert_loop", "autoep_expert_loop"):
            if getattr(self, name) not in EXPERT_LOOPS:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(EXPERT_LOOPS)}")

    def loop_at(self, ep_size: int) -> str:
        """How the experts run at this ``ep_size``: the model's blocks at 1, AutoEP's layer above."""
        return self.expert_loop if ep_size <= 1 else self.autoep_expert_loop


EXPERT_LOOPS = ("grouped", "modules", "slices")


def autoep_loop(precision: str) -> str:
    """How AutoEP's layer runs its experts on GPUs under the strategy: grouped GEMM in bf16
    (``torch._grouped_mm`` takes bf16 only; ``config.resolve.grouped_mm_applies``), a loop over
    slices otherwise."""
    return "grouped" if normalize_precision(precision) == "bf16" else "slices"


def expert_loop_of(model: Any) -> str:
    """How ``model``'s own MoE blocks run their experts, for the step time's expert-loop term
    (:class:`~lightning_zeromoe.planner.step_time.ModelShape`): ``"modules"`` when it holds a
    ``ModuleList`` named ``experts`` (the hand-written kind, older transformers models);
    ``"slices"`` when its transformers config asks for ``experts_implementation="eager"`` (a loop over
    fused expert tensors); else ``"grouped"`` (transformers 5's default, grouped GEMMs, or unknown)."""
    if model is None or not hasattr(model, "named_modules"):
        return "grouped"
    if any(type(m).__name__ == "ModuleList" and name.rpartition(".")[2] == "experts"
           for name, m in model.named_modules()):
        return "modules"
    from lightning_zeromoe._private.transformers import experts_implementation  # torch is loaded: a model

    return "slices" if experts_implementation(getattr(model, "config", None)) == "eager" else "grouped"


def looped_experts(shape: CommShape, model: ModelShape) -> int:
    """Experts one rank runs one at a time per MoE layer and micro-batch: its own experts
    (``num_experts / ep_size``) when the blocks loop over them, else 0."""
    if model.loop_at(shape.ep_size) == "grouped" or not shape.moe_layers:
        return 0
    return shape.num_experts // max(1, shape.ep_size)


def expert_loop_time(shape: CommShape, model: ModelShape, hardware: Hardware) -> float:
    """Seconds per optimizer step of the expert loop on one rank (module docstring, "the expert loop")."""
    looped = looped_experts(shape, model)
    if not looped:
        return 0.0
    per_expert = hardware.expert_loop_seconds
    if model.loop_at(shape.ep_size) == "slices":
        grad_bytes = _PRECISION_BYTES[normalize_precision(shape.precision)][1]
        local_bytes = shape.counts.expert_total / shape.moe_layers / max(1, shape.ep_size) * grad_bytes
        per_expert += 4 * local_bytes / hardware.memory_bandwidth
    return shape.accumulation * shape.moe_layers * looped * per_expert


def rank_gradient_elements(shape: CommShape) -> float:
    """Gradient elements one rank holds whole before a reduction: every dense parameter and the rank's
    own experts (all of them at ``ep_size=1``)."""
    counts = shape.counts
    return counts.dense_total + counts.expert_total / max(1, shape.ep_size)


def gradient_staging_time(shape: CommShape, hardware: Hardware) -> float:
    """Seconds per optimizer step of staging the rank's gradients for their reductions (module
    docstring, "gradient staging"): once per step at stage 1, once per micro-batch at stages 2 and 3."""
    reductions = 1 if shape.stage == 1 else shape.accumulation
    grad_bytes = _PRECISION_BYTES[normalize_precision(shape.precision)][1]
    return reductions * rank_gradient_elements(shape) * grad_bytes / hardware.gradient_staging_bandwidth


def flops_per_token(shape: CommShape, model: ModelShape) -> float:
    """Training FLOPs (forward + backward) per token: ``6 N_active + 12 L h s`` (8 and 16 with
    activation checkpointing). See the module docstring."""
    counts = shape.counts
    share = shape.top_k / shape.num_experts if shape.num_experts else 1.0
    active = counts.dense_total + counts.expert_total * share
    width = model.attention_width or shape.hidden_size
    passes = 4 if shape.activation_checkpointing else 3  # forward, backward (2x), + recomputed forward
    return 2 * passes * active + 4 * passes * model.attention_layers * width * model.seq_len


def module_count(shape: CommShape) -> int:
    """Modules with parameters: from ``param_order`` when given, else one per parameter tensor."""
    if shape.param_order is not None:
        return len({m for _, _, m in shape.param_order})
    return len(shape.counts.dense) + len(shape.counts.expert)


def partition_elements(shape: CommShape) -> float:
    """Elements of the optimizer's partition on one rank: dense over the world, each rank's experts
    over the expert-data-parallel group."""
    W, ep = shape.world, shape.ep_size
    apart = ep > 1
    dense = shape.counts.dense_total + (0 if apart else shape.counts.expert_total)
    local = shape.counts.expert_total / ep if apart else 0.0
    return dense / W + local / (W // ep)


def predict_step_time(shape: CommShape, hardware: Hardware = Hardware(), *, model: ModelShape = ModelShape(),
                      gpus_per_node: int | None = None, offload_optimizer: bool = False,
                      offload_parameters: bool = False, prediction: CommPrediction | None = None) -> StepTime:
    """Seconds of one optimizer step on one rank for this shape (see the module docstring).
    ``shape.tokens_per_micro_batch = 0`` leaves compute and all-to-all out (communication of
    parameters and gradients only: still enough to rank stages, whose compute is the same)."""
    prediction = prediction or predict(shape)
    per_node = gpus_per_node or shape.world
    tokens = shape.tokens_per_micro_batch * shape.accumulation
    flops = flops_per_token(shape, model) * tokens
    compute = flops / hardware.flops_per_second
    elements = partition_elements(shape)
    calls = calls_per_step(shape, prediction)
    comm: dict[tuple[str, str], float] = {}
    groups: dict[tuple[str, str], tuple[int, int, bool]] = {}
    grad_time = 0.0
    for (collective, group), nbytes in prediction.bytes.items():
        n = group_size(group, shape.world, shape.ep_size)
        spans = spans_nodes(group, shape.world, shape.ep_size, per_node)
        link = hardware.link(collective, spans, n, ranks_per_node(group, shape.world, shape.ep_size, per_node))
        count = calls.get((collective, group), 1) if n > 1 else 0
        seconds = nbytes * bus_factor(collective, n) / link.bandwidth + count * link.latency
        comm[(collective, group)] = seconds
        groups[(collective, group)] = (count, n, spans)
        if prediction.kinds.get((collective, group)) == "grads":
            grad_time += seconds
    offload = 0.0
    if offload_optimizer:
        p, g, _ = _PRECISION_BYTES[normalize_precision(shape.precision)]
        grad_host = g if shape.stage == 3 else 4
        offload = elements * (grad_host + p) / hardware.pcie_bandwidth + elements / hardware.cpu_adam_params_per_second
        if offload_parameters:
            gathered = sum(v for (c, _), v in prediction.bytes.items() if c == "all_gather")
            offload += gathered / max(1, shape.world) / hardware.pcie_bandwidth
    else:
        compute += elements / hardware.update_params_per_second
    expert_loop = expert_loop_time(shape, model, hardware)
    staging = gradient_staging_time(shape, hardware)
    zero3_host = 0.0
    if shape.stage == 3:
        zero3_host = 2 * shape.accumulation * module_count(shape) * hardware.zero3_module_seconds
    hidden = min(hardware.overlap * grad_time, compute * 2 / 3)
    total = compute + sum(comm.values()) + offload + expert_loop + staging + zero3_host - hidden
    overlap = (f"{hardware.overlap:.0%} of gradient-reduction time hidden behind backward ({hidden:.3g} s)"
               if hardware.overlap else StepTime.overlap)
    return StepTime(compute=compute, comm=comm, offload=offload, total=total, zero3_host=zero3_host,
                    flops_per_rank=flops, comm_bytes=prediction.total, expert_loop=expert_loop,
                    gradient_staging=staging, groups=groups, overlap=overlap)


def setup_step_time(shape: CommShape, setup: Setup, hardware: Hardware = Hardware(), **kwargs: object) -> StepTime:
    """:func:`predict_step_time` for one ladder setup (its stage and offload flags)."""
    from dataclasses import replace

    return predict_step_time(replace(shape, stage=setup.stage), hardware, offload_optimizer=setup.offload_optimizer,
                             offload_parameters=setup.offload_parameters, **kwargs)  # type: ignore[arg-type]


def format_seconds(seconds: float) -> str:
    """``1.23 s`` / ``45.6 ms`` / ``789 us``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


__all__ = ["EXPERT_LOOPS", "INFINIBAND", "NVLINK", "Hardware", "Link", "ModelShape", "StepTime", "autoep_loop",
           "bus_factor", "expert_loop_of", "expert_loop_time", "flops_per_token", "format_seconds",
           "gradient_staging_time", "group_ranks", "looped_experts", "module_count", "partition_elements",
           "predict_step_time", "rank_gradient_elements", "setup_step_time", "spans_nodes"]
