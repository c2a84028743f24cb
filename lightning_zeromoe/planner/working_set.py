"""Peak memory per rank during a training step: model states plus what DeepSpeed 0.19.8 allocates
while the step runs (gathered parameters, gradient buckets, activations, the optimizer step).

Each term follows a rule read from DeepSpeed's code (cited as ``file::function``, files under
``deepspeed/runtime/zero/``) and is reported twice: ``allocated``, what a device allocator must
hold, and ``resident``, the part written, which is what a CPU rank's resident set shows (a buffer
allocated with ``torch.empty`` and only partly filled is resident only where written). The two
differ for the gradient buckets: DeepSpeed allocates ``reduce_bucket_size`` elements whatever the
model's size, and fills only as many as the gradients in flight.

Two steps differ (``partitioned_param_coordinator.py``): the first records the module trace, and
without a complete trace every module's parameters are released after its forward and again after
its backward (``release_sub_module``); from the second step on, ``__params_to_release`` keeps every
parameter whose next use is within ``stage3_max_reuse_distance`` elements (default 1e9), so a
parameter gathered in forward stays gathered until its backward: a model under ~1e9 elements is
gathered whole at the end of the forward. Adam's states are created at the first ``step()``; the
gradient buckets are written during the first backward and stay resident.

The forward and the backward are walked module by module; at each point the rank holds the
parameters still gathered, the activations not yet consumed, the bucket so far and the module's
full-size gradients before they reach the bucket. Rules that matter at tens of MB (each measured,
``benchmarks/peak_memory.py``): a coalesced all-gather's flat buffer lives next to the parameter
copies made from it (``partition_parameters.py::AllGatherCoalescedHandle.wait``), and in a steady
step the prefetch gathers the next modules in one such buffer; in the first step, gathered expert
tensors indexed per expert stay alive through autograd's saved views until their backward (ZeRO-3's
release only swaps ``param.data``); the bucket's flush is copied once more by
``reduce_scatter_coalesced`` (and once again by gloo, which has no native reduce-scatter); stages
1/2 allocate their two buckets afresh each backward and free gradients before the optimizer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_zeromoe.planner.counts import GatherUnit, ParamCounts
from lightning_zeromoe.planner.memory import StateEstimate, _states
from lightning_zeromoe.planner.setups import Setup, _PRECISION_BYTES, normalize_precision

_CFG = "deepspeed/runtime/zero/config.py::DeepSpeedZeroConfig"


@dataclass(frozen=True)
class ZeroBuffers:
    """The ``zero_optimization`` values that size the working set (elements, DeepSpeed's defaults)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool = True

    @classmethod
    def strategy(cls) -> "ZeroBuffers":
        """What ``ZeroMoEStrategy`` passes by default (``config.deepspeed.ZeroOptions``; a test keeps
        the two equal): 5e7-element buckets, persistence threshold 1e5, DeepSpeed's other defaults."""
        return cls(reduce_bucket_size=50_000_000, allgather_bucket_size=50_000_000)

    @classmethod
    def from_config(cls, zero: Mapping[str, Any]) -> "ZeroBuffers":
        """From a ``zero_optimization`` section (the strategy's, :func:`config.deepspeed.zero_section`)."""
        keys = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
                "prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "param_persistence_threshold": "stage3_param_persistence_threshold",
                "max_live_parameters": "stage3_max_live_parameters",
                "max_reuse_distance": "stage3_max_reuse_distance",
                "contiguous_gradients": "contiguous_gradients", "overlap_comm": "overlap_comm"}
        return cls(**{ours: type(getattr(cls, ours))(zero[theirs]) for ours, theirs in keys.items() if theirs in zero})


@dataclass(frozen=True)
class Term:
    """One named amount of memory and the DeepSpeed rule it follows."""

    name: str
    allocated: float
    resident: float
    rule: str


@dataclass(frozen=True)
class PhasePeak:
    """One step: what the rank holds before it, and the extra at the backward's and the step's peaks."""

    phase: str
    held: tuple[Term, ...]
    backward: tuple[Term, ...]
    #: ``step()`` before the optimizer runs (gradients flattened) and while it runs (Adam).
    step: tuple[Term, ...]
    update: tuple[Term, ...] = ()

    def _peak(self, attr: str) -> float:
        held = sum(getattr(t, attr) for t in self.held)
        return held + max(sum(getattr(t, attr) for t in part) for part in (self.backward, self.step, self.update))

    @property
    def allocated(self) -> float:
        """Device bytes at the step's peak."""
        return self._peak("allocated")

    @property
    def resident(self) -> float:
        """Written bytes at the step's peak: what a CPU rank's resident set grows by."""
        return self._peak("resident")

    @property
    def where(self) -> str:
        parts = {"forward or backward": self.backward, "step, before the optimizer": self.step,
                 "optimizer update": self.update}
        return max(parts, key=lambda k: sum(t.resident for t in parts[k]))

    def rows(self) -> list[str]:
        out = [f"{self.phase} step (peak in the {self.where}):"]
        for part, terms in (("held", self.held), ("backward", self.backward), ("step", self.step),
                            ("update", self.update)):
            out += [f"  {part:8s} {t.name:42s} {t.resident / 2**20:9.2f} MiB resident "
                    f"{t.allocated / 2**20:9.2f} MiB allocated  [{t.rule}]" for t in terms]
        return out


@dataclass(frozen=True)
class PeakEstimate:
    setup: Setup
    states: StateEstimate
    first: PhasePeak
    steady: PhasePeak
    notes: tuple[str, ...] = field(default_factory=tuple)

    def table(self) -> str:
        return "\n".join(self.first.rows() + self.steady.rows())


def _bucket_fill(order: list[tuple[int, str]], bucket: int, by_group: bool, buffers: int) -> list[int]:
    """Most elements ever written in each of the ``buffers`` ipg buffers, gradients arriving in
    ``order`` as (elements, partition group). Stage 3 flushes when the group changes or the bucket
    is full (``stage3.py::reduce_independent_p_g_buckets_and_remove_grads``); stages 1/2 when full,
    then swap to the other buffer with ``overlap_comm`` (``stage_1_and_2.py::
    reduce_independent_p_g_buckets_and_remove_grads``). A gradient over the bucket bypasses it."""
    fill, index, elements, group = [0] * buffers, 0, 0, None
    for numel, grp in order:
        if numel > bucket:
            continue
        if elements and (elements + numel > bucket or (by_group and grp != group)):
            elements, index = 0, (index + 1) % buffers if elements + numel > bucket else index
        elements += numel
        group = grp
        fill[index] = max(fill[index], elements)
    return fill


def _flush_points(units_grads: list[list[tuple[int, str]]], bucket: int) -> list[int]:
    """Stage 3: for each module in backward order, the largest bucket flushed while its gradients
    arrive (a change of partition group or a full bucket), and last, the epilogue's flush
    (``stage3.py::independent_gradient_partition_epilogue``)."""
    out, elements, group = [], 0, None
    for grads in units_grads:
        biggest = 0
        for numel, grp in grads:
            if numel > bucket:
                continue
            if elements and (elements + numel > bucket or grp != group):
                biggest, elements = max(biggest, elements), 0
            elements += numel
            group = grp
        out.append(biggest)
    return out + [elements]


def estimate_peak(units: tuple[GatherUnit, ...], setup: Setup, *, world: int, ep_size: int = 1,
                  precision: str = "bf16", buffers: ZeroBuffers = ZeroBuffers(), activation_per_layer: float = 0.0,
                  activation_logits: float = 0.0, num_layers: int | None = None,
                  optimizer_bytes: int = 8, backend: str = "nccl",
                  activation_kept_per_layer: float | None = None) -> PeakEstimate:
    """Per-rank peak of the first and a steady step for ``setup`` (no offload modelled beyond the
    states), from the model's gather units in forward order. Activations: per decoder layer and
    the loss's logits (:func:`memory.estimate_activations`), both in bytes; with activation
    checkpointing, ``activation_kept_per_layer`` is what a layer keeps (its input) and the full
    ``activation_per_layer`` exists only during that layer's backward. ``backend``: ``"gloo"``
    has no native reduce-scatter, and its fallback holds one more copy of what is reduced."""
    precision = normalize_precision(precision)
    p, g, _ = _PRECISION_BYTES[precision]
    stage = setup.stage
    counts = ParamCounts(tuple(n for u in units for n, e in zip(u.sizes, u.expert) if not e),
                         tuple(n for u in units for n, e in zip(u.sizes, u.expert) if e))
    st = _states(counts, setup, world, ep_size, precision, optimizer_bytes)
    edp = world // ep_size

    def group(expert: bool) -> int:  # the ZeRO partition group's size of a tensor
        return edp if expert and ep_size > 1 else world

    layers = num_layers if num_layers is not None else 1 + max([u.layer for u in units if u.layer is not None],
                                                               default=-1)
    # Position of each unit among the layers: before the first layer (embeddings), a layer, after.
    seen_layer, pos = False, []
    for u in units:
        seen_layer = seen_layer or u.layer is not None
        pos.append(u.layer if u.layer is not None else (layers if seen_layer else -1))
    local = [u.local(ep_size) for u in units]
    thr = buffers.param_persistence_threshold if stage == 3 else -1
    persistent = [[n for n in sizes if n <= thr] for sizes in local]
    # Tensors ZeRO-3 gathers: over the persistence threshold, partitioned over a group of 2+ ranks.
    # Stages 1/2 keep every parameter whole and gather nothing.
    gathers = [[(n, e) for n, e in zip(sizes, u.expert) if stage == 3 and n > thr and group(e) > 1]
               for sizes, u in zip(local, units)]
    gatherable = [sum(n for n, _ in g_) for g_ in gathers]

    held: list[Term] = [Term("parameters" + (" (partitions)" if stage == 3 else ""), st.params, st.params,
                             "stage3.py / stage_1_and_2.py: flat parameter groups"),
                        Term("fp32 master partition", st.master, st.master,
                             "stage_1_and_2.py single_partition_of_fp32_groups / stage3.py fp32_partitioned_groups_flat")]
    if stage == 3:
        held.append(Term("gradient partitions", st.grads, st.grads,
                         "stage3.py::create_reduce_and_remove_grad_hooks grad_partitions_flat_buffer (zeros at init)"))
    # ---- gradient buckets
    per_unit = [[(n, "expert" if e and ep_size > 1 else "dense") for n, e in zip(reversed(sizes), reversed(u.expert))]
                for sizes, u in zip(reversed(local), reversed(units))]  # gradients in backward order
    order = [grad for grads in per_unit for grad in grads]
    nbuf = 1 if stage == 3 else (2 if buffers.overlap_comm else 1)
    fill = _bucket_fill(order, buffers.reduce_bucket_size, stage == 3, nbuf) if buffers.contiguous_gradients else [0]
    # stage3.py::__reduce_and_partition_ipg_grads -> __avg_scatter_grads (reduce_scatter is on by
    # default) -> comm/coalesced_collectives.py::reduce_scatter_coalesced: torch.cat of the bucket's
    # gradients, padded per rank: one more copy of what is flushed, while the bucket still holds it.
    flushes = _flush_points(per_unit, buffers.reduce_bucket_size) if stage == 3 else [0] * (len(units) + 1)
    copies = 2 if backend == "gloo" and world > 1 else 1
    bucket_alloc = (buffers.reduce_bucket_size * nbuf if buffers.contiguous_gradients else 0) * g
    bucket_rule = ("stage3.py::create_reduce_and_remove_grad_hooks (allocated at init), filled by "
                   "__add_grad_to_ipg_bucket" if stage == 3 else
                   "stage_1_and_2.py::setup_buckets (two with overlap_comm, each backward), filled by "
                   "reduce_independent_p_g_buckets_and_remove_grads")
    bucket = Term("ipg gradient bucket" + (" (x2)" if nbuf == 2 else ""), bucket_alloc, sum(fill) * g, bucket_rule)
    # ---- gathered parameters (stage 3)
    persist_bytes = p * sum(map(sum, persistent))
    persist = Term("persistent parameters, whole", persist_bytes, persist_bytes,
                   "parameter_offload.py::mark_persistent_parameters (numel <= stage3_param_persistence_threshold)")
    retained = [False] * len(units)
    if stage == 3:
        after = 0
        for i in reversed(range(len(units))):
            retained[i] = 2 * after < buffers.max_reuse_distance
            after += gatherable[i]

    # Written by the end of the backward besides the bucket: the rank's gradient partition, which
    # stage_1_and_2.py::reduce_ipg_grads copies out of the bucket (copy_grads_in_partition) in stage 2
    # and, with contiguous_gradients, in stage 1 too (its "zero stage 1" branch); for stage 1 with a
    # model larger than the buckets, its gradients beyond the bucket if that is more.
    shard = st.master / 4 if st.master else 0.0  # elements of the rank's fp32 master partition
    partition = shard * g
    if stage == 2:
        part2 = st.grads
    elif stage == 1:
        part2 = max(partition if buffers.contiguous_gradients else 0.0, st.grads - g * sum(fill))
    else:
        part2 = 0.0

    # Gathered expert tensors are indexed per expert (fused 3-D layout: Hugging Face Mixtral, ours,
    # AutoEP's CPU loop); autograd saves those views, which keep the gathered storage alive after
    # partition_parameters.py::free_param swaps ``param.data`` out, until that module's backward.
    viewed = [p * sum(n for n, e in g_ if e) for g_ in gathers]
    # partition_parameters.py::_all_gather_dtype gathers 2+ tensors into one flat buffer and
    # AllGatherCoalescedHandle.wait copies each parameter out of it (torch.cat): 2x until the handle goes.
    coalesced = [len(g_) > 1 for g_ in gathers]

    ckpt = activation_kept_per_layer is not None
    kept_act = activation_kept_per_layer if ckpt else activation_per_layer
    if ckpt:  # checkpointed layers drop the saved views too; their recompute gathers again
        viewed = [0.0] * len(units)

    def acts_before(i: int, inclusive: bool) -> float:
        n = sum(1 for layer in range(layers) if (layer <= pos[i] if inclusive else layer < pos[i]))
        recompute = activation_per_layer if ckpt and inclusive and 0 <= pos[i] < layers else 0.0
        return kept_act * n + recompute + (activation_logits if inclusive and pos[i] >= layers else 0.0)

    def grads_of(i: int) -> float:
        """Autograd's full-size gradients of one module before they reach the bucket: its largest
        tensor, or for fused experts all of them plus one more of the largest (each expert's
        SelectBackward is full-size and is added into the running sum)."""
        sizes, exp = local[i], [n for n, e in zip(local[i], units[i].expert) if e]
        return g * (sum(exp) + max(exp) if exp else max(sizes))

    def walk(steady: bool) -> tuple[float, str]:
        """The extra resident bytes at the forward's and backward's worst point, and where it is."""
        points: list[tuple[float, str]] = []
        if stage == 3 and steady:
            # partitioned_param_coordinator.py::_fetch_sub_module_impl prefetches the next modules'
            # parameters in one coalesced gather of up to stage3_prefetch_bucket_size elements; its
            # buffer lives until the last of them is fetched, next to their copies.
            largest = max((n for g_ in gathers for n, _ in g_), default=0)  # the loop adds whole parameters
            chunk = min(sum(gatherable[1:]), buffers.prefetch_bucket_size + largest, buffers.max_live_parameters)
            gathered = p * sum(n for n, keep in zip(gatherable, retained) if keep)
            points.append((gathered + p * chunk + kept_act * layers, "forward, prefetch buffer alive"))
        else:
            gathered = 0.0
            for i in range(len(units)):  # first step: one module at a time, views kept by autograd
                fetch = p * gatherable[i] * (2 if coalesced[i] else 1)
                points.append((sum(viewed[:i]) + fetch + acts_before(i, False), f"forward of {units[i].name}"))
        points.append((gathered + (sum(viewed) if not steady else 0.0) + kept_act * layers
                       + activation_logits, "end of forward"))
        so_far = 0
        for k, i in enumerate(reversed(range(len(units)))):
            u, sizes = units[i], local[i]
            reduce = g * copies * flushes[k]
            kept = 0.0 if steady else sum(viewed[:i + 1])
            here = gathered + (0.0 if retained[i] and steady else p * gatherable[i])
            so_far += sum(sizes)
            written = 0.0 if steady and stage == 3 else g * min(so_far, sum(fill))
            act = acts_before(i, True)
            if coalesced[i] and not (steady and retained[i]):
                points.append((kept + here + p * gatherable[i] + act + written, f"backward fetch of {u.name}"))
            points.append((kept + here + act + grads_of(i) + written + reduce, f"backward of {u.name}"))
            if steady and retained[i]:
                gathered -= p * gatherable[i]
        points.append(((0.0 if steady and stage == 3 else g * sum(fill) + part2) + g * copies * flushes[-1],
                       "end of backward (epilogue's reduce-scatter)"))
        return max(points)

    phases = {}
    for steady in (False, True):
        hold = list(held)
        # Held from the first backward on (written during it): the bucket's filled part, stage 2's
        # gradient partition, stage 3's persistent parameters (gathered at first use, never released).
        kept = [Term(bucket.name, 0.0, bucket.resident, bucket.rule)]
        if stage == 1 and part2 > partition:
            # a model larger than the buckets: stage 1 keeps every reduced gradient until step()
            # (the states' full gradients; measured between the stage-2 partition and this figure)
            kept.append(Term("gradients beyond the bucket", part2, part2,
                             "stage_1_and_2.py (partition_gradients=False): gradients kept until step()"))
        elif stage == 1 and part2:
            kept.append(Term("gradient partition", part2, part2,
                             "stage_1_and_2.py::reduce_ipg_grads (zero stage 1) copy_grads_in_partition"))
        if stage == 2:
            kept.append(Term("gradient partition", st.grads, st.grads,
                             "stage_1_and_2.py::copy_grads_in_partition grads_in_partition (first backward)"))
        if stage == 3:
            kept.append(persist)
        hold.append(Term(bucket.name + " (allocated)", bucket.allocated, 0.0, bucket.rule))
        value, where = walk(steady)
        walk_term = Term(f"working set ({where})", value, value,
                         "partitioned_param_coordinator.py::fetch_sub_module/release_sub_module"
                         + ("/__params_to_release (trace complete)" if steady else " (no trace: release each module)")
                         + "; activations; autograd gradients before reduce_independent_p_g_buckets_and_remove_grads")
        opt = Term("optimizer states", st.optimizer, st.optimizer, "torch.optim Adam state, created at the first step()")
        if steady and stage == 3:
            hold += kept + [opt]
            kept, opt_now = [], []
        elif steady:
            # Stages 1/2 free the bucket and the gradient partition after each step (measured: a
            # steady step starts with the first step's holdings plus Adam's states, nothing more),
            # so a steady step fills them again exactly as the first did.
            hold.append(opt)
            opt_now = []
        else:
            opt_now = [opt]
        # the bucket and stage 2's partition are in the walk; stage 3's persistent parameters are not
        bwd = [walk_term] + [t for t in kept if t is persist]
        flat_t = Term("flattened gradient partition", shard * g, shard * g,
                      "stage3.py::_prepare_fp32_grad_for_sub_group" if stage == 3
                      else "stage_1_and_2.py::step flatten(averaged_gradients)")
        extra = [flat_t]
        if st.step_transient > shard * g:
            extra.append(Term("fp32 copy of the gradient partition", st.step_transient - shard * g,
                              st.step_transient - shard * g, "stage3.py::_prepare_fp32_grad_for_sub_group"))
        # torch's Adam, one flat fp32 partition per parameter group (dense, and experts under EP):
        # ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)``: two temporaries of the largest group.
        groups = [sum(-(-n // world) for n in counts.dense)]
        if ep_size > 1:
            groups.append(sum(-(-(n // ep_size) // edp) for n in counts.expert))
        else:
            groups[0] += sum(-(-n // world) for n in counts.expert)
        scratch = 2 * 4 * max(groups) if st.master else 0.0
        scratch_t = Term("Adam scratch (sqrt, quotient)", scratch, scratch, "torch/optim/adam.py::_single_tensor_adam denom")
        if stage == 3:  # stage3.py::step: flatten, update and free one sub-group at a time; the bucket stays
            stp, upd = kept + extra, kept + extra + opt_now + [scratch_t]
        else:
            # stage_1_and_2.py::step: every group's gradient is flattened (the bucket still holds the
            # full gradients, stage 2's partition too), then free_grad_in_param_list frees them before
            # the optimizer runs.
            stp, upd = kept + extra, extra + opt_now + [scratch_t]
        phases[steady] = PhasePeak("steady" if steady else "first", tuple(hold), tuple(bwd), tuple(stp), tuple(upd))
    return PeakEstimate(setup=setup, states=st, first=phases[False], steady=phases[True])
