"""Communication model: bytes per optimizer step by collective and process group, predicted.

The same breakdown :class:`~lightning_zeromoe.observe.comm_ledger.CommLedger` measures, with the
same definition of bytes (the full buffer of each call, per rank: the ``nccl-tests`` convention;
see the ledger's docstring), from the parameter sizes, the ZeRO stage, ``ep_size``, world size,
precision, top-k, hidden size, tokens per micro-batch and gradient accumulation. Each term is read
from deepspeed 0.19.8's code and checked against the ledger on CPU ranks
(``tests/test_comm_ledger.py``). Notation: ``Pd``/``Pe`` dense/expert elements (``Pe``: all experts
of every layer), ``W`` world size, ``ep`` the expert-parallel size, ``D = W / ep`` the
expert-data-parallel size, ``p``/``g`` bytes per weight/gradient element, ``A`` accumulation steps.

ZeRO-1/2 (``runtime/zero/stage_1_and_2.py``)
  * gradients: ``average_tensor`` reduces each bucket with ``all_reduce`` (``allreduce_and_scatter``:
    ``use_multi_rank_bucket_allreduce`` is on by default), never ``reduce_scatter``: ``Pd * g`` on
    the world group and ``Pe / ep * g`` on the expert-data-parallel group (called even when that
    group has one rank). Stage 2 reduces after every micro-batch (``partition_gradients``); stage 1
    only at the accumulation boundary (``reduce_ready_partitions_and_remove_grads``).
  * parameters: after ``step()``, ``all_gather_dp_groups`` -> ``all_gather_into_tensor`` of each
    flat group, padded to a multiple of ``2 * group size``: ``pad(Pd) * p`` on the world group and,
    when ``D > 1``, ``pad(Pe / ep) * p`` on the expert-data-parallel group (skipped when ``D = 1``).
  * gradient norm (computed every step, clipping or not): one 4-byte ``all_reduce`` on the world
    group per flat group (``get_grad_norm_direct``) and, with expert groups, one on the
    expert-data-parallel group (``_average_expert_grad_norms``); in bf16/fp16 one more byte, the
    overflow flag.

ZeRO-3 (``runtime/zero/stage3.py``, ``partition_parameters.py``, ``partitioned_param_coordinator.py``)
  * parameters: every micro-batch's forward gathers each partitioned tensor
    (``all_gather_into_tensor`` of ``ceil(n / group) * group`` elements, ``p`` bytes): dense on the
    world group, experts on the expert-data-parallel group (none when ``D = 1``). Tensors of at
    most ``param_persistence_threshold`` elements persist and are not gathered. After the first
    step (the trace is recorded then, and everything is gathered again in backward), a tensor is
    gathered again in backward only when more than ``max_reuse_distance`` elements (1e9) are
    used between its forward and its backward use (``__params_to_release``); this model counts
    that distance as twice the elements of the modules after the tensor's in ``param_order``, or
    when the prefetcher (``stage3_prefetch_bucket_size`` elements ahead) has passed that backward
    use already (:func:`regathered`).
  * gradients: every micro-batch, ``reduce_scatter_tensor`` of ``Pd * g`` on the world group and
    ``Pe / ep * g`` on the expert-data-parallel group.
  * gradient norm: one 8-byte ``all_reduce`` on the world group, and with expert groups one each
    on the expert-data-parallel and expert-parallel groups (``get_grad_norm_direct``).

AutoEP (``module_inject/auto_ep_layer.py``), ``ep > 1``, per MoE layer and micro-batch, ``T`` tokens:
  * ``all_to_all_single`` of the per-expert counts: ``E * 4`` bytes (int32), forward only;
  * dispatch and combine in forward, their gradients in backward: four ``all_to_all_single`` of
    ``T * k * h * a`` bytes (``a``: activation bytes) on average over ranks (what a rank sends in
    combine is what it received in dispatch, which depends on routing; summed over ranks both are
    ``T * k`` rows); activation checkpointing repeats the forward (two more, and the counts).

Lightning: one 8-byte ``broadcast`` on the world group per training batch (the SIGTERM flag,
``training_epoch_loop.py``). Not modelled: collectives of other callbacks, validation, the first
step's trace bookkeeping and the strategy's gradient audit (first ``grad_audit_steps`` steps).

Pure module: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_zeromoe.planner.counts import ParamCounts
from lightning_zeromoe.planner.setups import _PRECISION_BYTES, normalize_precision

#: Ledger cells: (collective, group) -> kind, for :meth:`CommPrediction.by_kind`.
KINDS = ("grads", "params", "all_to_all", "other")


@dataclass(frozen=True)
class CommShape:
    """What the traffic of one optimizer step depends on."""

    counts: ParamCounts
    stage: int
    world: int
    ep_size: int = 1
    precision: str = "bf16"
    top_k: int = 2
    hidden_size: int = 0
    moe_layers: int = 0
    num_experts: int = 0
    tokens_per_micro_batch: int = 0
    accumulation: int = 1
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_reuse_distance: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000
    activation_checkpointing: bool = False
    #: ZeRO-3's first step gathers everything in backward too (the trace is being recorded).
    first_step: bool = False
    #: (elements, is_expert, module name) per parameter tensor in forward order (``named_parameters``);
    #: None: dense then experts, one module each.
    param_order: tuple[tuple[int, bool, str], ...] | None = None
    #: Flat parameter groups of ZeRO-1/2 that are not expert groups (the optimizer's param groups).
    dense_param_groups: int = 1
    #: Trained by Lightning (its per-batch SIGTERM broadcast); False for a raw DeepSpeed loop.
    lightning: bool = True


@dataclass(frozen=True)
class CommPrediction:
    """Bytes per optimizer step, per rank, by (collective, group), and the kind of each cell."""

    shape: CommShape
    bytes: dict[tuple[str, str], float] = field(default_factory=dict)
    kinds: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def by_kind(self) -> dict[str, float]:
        return kind_totals(self.bytes, self.kinds)


def kind_totals(cells: dict[tuple[str, str], float], kinds: dict[tuple[str, str], str]) -> dict[str, float]:
    """Bytes per kind (:data:`KINDS`) of cells keyed by (collective, group)."""
    out = dict.fromkeys(KINDS, 0.0)
    for key, value in cells.items():
        out[kinds[key]] += value
    return out


class _Cells:
    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], float] = {}
        self.kinds: dict[tuple[str, str], str] = {}

    def add(self, collective: str, group: str, value: float, kind: str) -> None:
        if value:
            key = (collective, group)
            self.bytes[key] = self.bytes.get(key, 0.0) + value
            self.kinds.setdefault(key, kind)


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def predict(shape: CommShape) -> CommPrediction:
    """The bytes each rank passes to collectives in one optimizer step (see the module docstring)."""
    precision = normalize_precision(shape.precision)
    p, g, _ = _PRECISION_BYTES[precision]
    act = p  # activations travel in the weights' dtype (the engine casts the model)
    W, ep, A = shape.world, shape.ep_size, shape.accumulation
    D = W // ep
    counts = shape.counts
    experts_apart = ep > 1  # AutoEP's expert groups; at ep_size=1 experts are ordinary parameters
    dense = list(counts.dense) + ([] if experts_apart else list(counts.expert))
    local_expert = [n // ep for n in counts.expert] if experts_apart else []
    cells = _Cells()
    if W > 1 or experts_apart:
        if shape.stage in (1, 2):
            reductions = A if shape.stage == 2 else 1
            cells.add("all_reduce", "world", reductions * sum(dense) * g, "grads")
            cells.add("all_reduce", "expert_data_parallel", reductions * sum(local_expert) * g, "grads")
            cells.add("all_gather", "world", _pad(sum(dense), 2 * W) * p if W > 1 else 0, "params")
            if D > 1:
                cells.add("all_gather", "expert_data_parallel", _pad(sum(local_expert), 2 * D) * p, "params")
            groups = shape.dense_param_groups + (1 if experts_apart else 0)
            cells.add("all_reduce", "world", 4 * groups, "other")
            cells.add("all_reduce", "expert_data_parallel", 4 if experts_apart else 0, "other")
            cells.add("all_reduce", "world", 1 if p == 2 else 0, "other")  # 16-bit: the overflow flag (bf16: measured)
        elif shape.stage == 3:
            cells.add("all_gather", "world", A * _gathered(dense, W, p, shape.param_persistence_threshold), "params")
            if D > 1:
                cells.add("all_gather", "expert_data_parallel",
                          A * _gathered(local_expert, D, p, shape.param_persistence_threshold), "params")
            # Backward: the first micro-batch of the first step gathers everything again (trace not
            # complete yet); every other micro-batch only what the reuse distance released.
            threshold = shape.param_persistence_threshold
            for times, first in ((1, shape.first_step), (A - 1, False)):
                again_dense, again_expert = _regathered(shape, first)
                cells.add("all_gather", "world", times * _gathered(again_dense, W, p, threshold), "params")
                if D > 1:
                    cells.add("all_gather", "expert_data_parallel", times * _gathered(again_expert, D, p, threshold),
                              "params")
            cells.add("reduce_scatter", "world", A * sum(dense) * g, "grads")
            cells.add("reduce_scatter", "expert_data_parallel", A * sum(local_expert) * g, "grads")
            cells.add("all_reduce", "world", 8, "other")
            if experts_apart:
                cells.add("all_reduce", "expert_data_parallel", 8, "other")
                cells.add("all_reduce", "expert_parallel", 8, "other")
    if experts_apart and shape.moe_layers:
        forwards = 2 if shape.activation_checkpointing else 1
        rows = shape.tokens_per_micro_batch * shape.top_k * shape.hidden_size * act
        per_layer = (2 * forwards + 2) * rows + forwards * shape.num_experts * 4
        cells.add("all_to_all", "expert_parallel", A * shape.moe_layers * per_layer, "all_to_all")
    if W > 1 and shape.lightning:
        cells.add("broadcast", "world", 8 * A, "other")
    return CommPrediction(shape, cells.bytes, cells.kinds)


def _gathered(sizes: list[int], group: int, p: int, threshold: int) -> float:
    if group <= 1:
        return 0.0
    return float(sum(_pad(n, group) * p for n in sizes if n > threshold))


def forward_order(shape: CommShape) -> list[tuple[int, bool, str]]:
    """(elements on this rank, gathered over the expert-data-parallel group, module) per parameter
    tensor in forward order: ``param_order`` when given, else dense then experts, one module each.
    At ``ep_size=1`` experts are ordinary (world) parameters."""
    apart = shape.ep_size > 1
    if shape.param_order is not None:
        return [(n // shape.ep_size if e and apart else n, e and apart, m) for n, e, m in shape.param_order]
    order = [(n, False, f"d{i}") for i, n in enumerate(shape.counts.dense)]
    return order + [(n // shape.ep_size if apart else n, apart, f"e{i}") for i, n in enumerate(shape.counts.expert)]


def regathered(shape: CommShape, first: bool) -> list[tuple[int, bool, str]]:
    """Tensors (as in :func:`forward_order`) ZeRO-3 gathers again in backward: all on the first step;
    afterwards those of a module whose forward and backward uses are ``max_reuse_distance`` elements
    or more apart. Between the two uses ZeRO-3's trace holds every later module twice (forward, then
    backward), so the distance is twice the elements of the modules after it
    (``__params_to_release``). A tensor is also kept when the prefetcher, which walks the trace
    ``prefetch_bucket_size`` elements of not-yet-gathered parameters ahead, has already passed its
    backward use when forward releases it (``__most_recent_step_id_param_fetched_for``): first
    order, when the modules after it hold fewer elements than the prefetch bucket."""
    order = forward_order(shape)
    modules: dict[str, int] = {}
    for n, _, m in order:
        modules[m] = modules.get(m, 0) + n
    after, later = {}, 0
    for m in reversed(list(modules)):
        after[m] = later
        later += modules[m]
    return [(n, e, m) for n, e, m in order
            if first or not (2 * after[m] < shape.max_reuse_distance or after[m] < shape.prefetch_bucket_size)]


def _regathered(shape: CommShape, first: bool) -> tuple[list[int], list[int]]:
    """:func:`regathered`'s element counts: (dense, expert)."""
    again = regathered(shape, first)
    return [n for n, e, _ in again if not e], [n for n, e, _ in again if e]


__all__ = ["CommPrediction", "CommShape", "KINDS", "forward_order", "kind_totals", "predict", "regathered"]
