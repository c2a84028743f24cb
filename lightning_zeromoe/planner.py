"""Memory planner: what each GPU holds under ZeRO stages 1-3, with expert parallelism and offload.

Why it exists: the usual advice ("ZeRO-1 is 1/4, ZeRO-2 1/8, ZeRO-3 1/N") is the large-N limit
of the ZeRO paper's formulas and ignores that experts are *not* sharded like dense weights. With
expert parallelism, a layer's experts are split over ``ep_size`` ranks, and each rank's share is
replicated on ``world / ep_size`` ranks (expert data parallelism); ZeRO can only partition an
expert's states over those ``world / ep_size`` replicas. Dense weights are partitioned over all
``world`` ranks. So, per GPU, for a precision with ``p`` bytes per weight, ``g`` per gradient,
``m`` per master weight and ``o`` per optimizer-state element (Adam: 8)::

    stage 0:  (p + g + m + o) * Psi
    stage 1:  (p + g) * Psi + (m + o) * Psi / D
    stage 2:  p * Psi + (g + m + o) * Psi / D
    stage 3:  (p + g + m + o) * Psi / D

with ``Psi = dense, D = world`` for dense weights and ``Psi = experts / ep_size, D = world / ep_size``
for expert weights. For bf16/fp16 (p = g = 2, m = 4, o = 8) these are the ZeRO paper's
``4Psi + 12Psi/N``, ``2Psi + 14Psi/N`` and ``16Psi/N`` (Rajbhandari et al., 2020). In fp32
(``p = g = m = 4``) DeepSpeed 0.19.8 still keeps a *separate* fp32 master partition in every stage
(measured: ``tests/test_planner.py``), so fp32 costs 20 bytes per parameter, not 16.

When a model is given, the planner rounds the way DeepSpeed does (ZeRO-3: each tensor's partition
is ``ceil(numel / D)``; stages 1/2: each parameter group's flat buffer is padded to a multiple of
``2 * D`` elements), so its figures match what ``telemetry.state_bytes`` reads from a live engine.

Offload (``offload_optimizer``) moves the fp32 master weights and optimizer states to host memory,
and the gradient partitions with them (stage 3: in the gradient dtype; stages 1/2: an fp32 copy), so
the device keeps gradients only transiently, in the reduce bucket. ``offload_parameters`` (stage 3)
moves the parameter partitions too. These are modelled from DeepSpeed's code and not measured here
(a CPU-only test machine has no device memory to offload from).

Pure module: no torch, DeepSpeed or Lightning import at module level (a model, if given, is only
iterated with ``named_parameters()``), so ``python -m lightning_zeromoe.planner`` is instant.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

GB = 10**9
GIB = 2**30

#: (weight, gradient, master weight) bytes per element. The optimizer adds ``optimizer_bytes``.
_PRECISION_BYTES = {"fp32": (4, 4, 4), "bf16": (2, 2, 4), "fp16": (2, 2, 4)}
_PRECISION_ALIASES = {
    "32": "fp32", "32-true": "fp32", "fp32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "bfloat16": "bf16",
    "16": "fp16", "16-mixed": "fp16", "16-true": "fp16", "fp16": "fp16", "float16": "fp16",
}

#: DeepSpeed stage 1/2 pads each flat parameter group to a multiple of this times the group size
#: (``nccl_start_alignment_factor`` in ``stage_1_and_2.py``).
_STAGE12_ALIGNMENT = 2


def normalize_precision(precision: str | int) -> str:
    """Lightning's and DeepSpeed's precision spellings -> ``fp32`` | ``bf16`` | ``fp16``."""
    key = str(precision).lower()
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(_PRECISION_ALIASES)}")
    return _PRECISION_ALIASES[key]


# ---------------------------------------------------------------------------------------- setups

@dataclass(frozen=True, order=True)
class Setup:
    """One ZeRO configuration. Ordered from least to most aggressive (more communication, or
    PCIe traffic and CPU optimizer time), which is the order :meth:`Plan.recommend` tries them."""

    rank: int
    stage: int
    offload_optimizer: bool = False
    offload_parameters: bool = False

    @property
    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer:
            parts.append("offload optimizer")
        if self.offload_parameters:
            parts.append("offload params")
        return " + ".join(parts)

    def strategy_kwargs(self) -> dict[str, Any]:
        """The ``ZeroMoEStrategy`` arguments for this setup."""
        return {"stage": self.stage, "offload_optimizer": self.offload_optimizer,
                "offload_parameters": self.offload_parameters}


#: The seeds' advice: no ZeRO-3 while 1 or 2 fits, no offload while anything on-device fits.
LADDER = (
    Setup(0, 1), Setup(1, 2), Setup(2, 3),
    Setup(3, 2, offload_optimizer=True), Setup(4, 3, offload_optimizer=True),
    Setup(5, 3, offload_optimizer=True, offload_parameters=True),
)


# ---------------------------------------------------------------------------------------- counts

@dataclass(frozen=True)
class ParamCounts:
    """Parameter tensor sizes (elements), dense and expert. Expert tensors are the *whole*
    layer's experts (all ``num_experts``), before expert parallelism splits them."""

    dense: tuple[int, ...]
    expert: tuple[int, ...]
    #: False when only totals were given: then partitions are computed without rounding.
    exact: bool = True

    @property
    def dense_total(self) -> int:
        return sum(self.dense)

    @property
    def expert_total(self) -> int:
        return sum(self.expert)

    @property
    def total(self) -> int:
        return self.dense_total + self.expert_total


def is_expert_param(name: str) -> bool:
    """Routed-expert weights: a path component named ``experts`` (ours, Hugging Face Mixtral /
    Qwen-MoE / DeepSeek, AutoEP's replacement). ``shared_experts`` are dense: every rank runs them."""
    return "experts" in name.split(".")


def count_params(model: Any, is_expert: Callable[[str], bool] = is_expert_param) -> ParamCounts:
    """Sizes of a model's trainable parameters, split into dense and expert. Works on a plain
    module (before AutoEP); tied parameters are counted once, as ``named_parameters`` yields them."""
    dense, expert = [], []
    for name, param in model.named_parameters():
        if not getattr(param, "requires_grad", True):
            continue
        numel = int(math.prod(getattr(param, "ds_shape", None) or param.shape))
        (expert if is_expert(name) else dense).append(numel)
    return ParamCounts(tuple(dense), tuple(expert))


def moe_transformer_counts(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                           num_kv_heads: int, ffn_hidden_size: int, num_experts: int,
                           head_dim: int | None = None, tie_embeddings: bool = False) -> ParamCounts:
    """Parameter tensors of a Mixtral-style decoder: GQA attention without biases, RMSNorm,
    a router ``Linear(hidden, num_experts)`` and SwiGLU experts (3 matrices of hidden x ffn) in
    every layer. Used for models too large to build, even on the meta device, in a test."""
    head_dim = head_dim or hidden_size // num_heads
    per_layer = [
        hidden_size * num_heads * head_dim,  # q
        hidden_size * num_kv_heads * head_dim,  # k
        hidden_size * num_kv_heads * head_dim,  # v
        num_heads * head_dim * hidden_size,  # o
        hidden_size, hidden_size,  # input / post-attention RMSNorm
        num_experts * hidden_size,  # router
    ]
    dense = [vocab_size * hidden_size] + per_layer * num_layers + [hidden_size]
    if not tie_embeddings:
        dense.append(vocab_size * hidden_size)
    expert = [num_experts * 2 * ffn_hidden_size * hidden_size, num_experts * hidden_size * ffn_hidden_size] * num_layers
    return ParamCounts(tuple(dense), tuple(expert))


#: Mixtral-8x7B (``mistralai/Mixtral-8x7B-v0.1`` config.json): 46,702,792,704 parameters.
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, num_experts=8)


# ---------------------------------------------------------------------------------------- bytes

@dataclass(frozen=True)
class StateEstimate:
    """Bytes one GPU holds for one setup. ``host`` is what offload keeps in CPU memory per GPU."""

    setup: Setup
    params: float
    grads: float
    master: float
    optimizer: float
    host: float
    dense: float
    expert: float
    #: Extra bytes that exist only while ``optimizer.step()`` runs (see :func:`_states`).
    step_transient: float = 0.0

    @property
    def device_total(self) -> float:
        """What the rank holds between steps (measured equal on CPU ranks, fp32 and bf16)."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def step_peak(self) -> float:
        """The most the rank holds while ``step()`` runs: :attr:`device_total` plus the transient."""
        return self.device_total + self.step_transient


def _partition(sizes: Iterable[int], group: int, total: int, stage: int, exact: bool) -> float:
    """Elements of ``sizes`` one rank of a ZeRO group of ``group`` ranks holds, rounded like
    DeepSpeed when ``exact`` (ZeRO-3: per tensor; stage 1/2: the flat group, padded)."""
    if group == 1:
        return float(total)
    if not exact:
        return total / group
    if stage == 3:
        return float(sum(-(-n // group) for n in sizes))
    align = _STAGE12_ALIGNMENT * group
    return float(-(-total // align) * align // group)


def _states(counts: ParamCounts, setup: Setup, world: int, ep_size: int, precision: str,
            optimizer_bytes: int) -> StateEstimate:
    p, g, m = _PRECISION_BYTES[precision]
    o = optimizer_bytes
    stage = setup.stage
    parts = []  # (full local elements, partitioned local elements) for dense, then experts
    parts.append((counts.dense_total, _partition(counts.dense, world, counts.dense_total, stage, counts.exact)))
    edp = world // ep_size
    local_expert = [n // ep_size for n in counts.expert]
    local_total = sum(local_expert) if counts.exact else counts.expert_total / ep_size
    parts.append((local_total, _partition(local_expert, edp, int(local_total), stage, counts.exact)))

    sums = {"params": 0.0, "grads": 0.0, "master": 0.0, "optimizer": 0.0, "host": 0.0, "step_transient": 0.0}
    split = []
    for full, shard in parts:
        w = (full if stage < 3 else shard) * p
        gr = (full if stage < 2 else shard) * g
        ms = shard * m
        op = shard * o
        if stage == 0:
            gr, ms, op = full * g, full * m, full * o
        host = 0.0
        if setup.offload_optimizer:
            host += ms + op
            ms = op = 0.0
            if stage == 3:  # DeepSpeed keeps stage-3 gradient partitions with the optimizer
                host += gr
            else:  # stages 1/2: reduced gradients are copied into an fp32 host partition
                host += shard * 4
            gr = 0.0  # on the device only transiently, in the reduce bucket
        if setup.offload_parameters:
            host += w
            w = 0.0
        # During step() (stage 3, DeepSpeed 0.19.8 _prepare_fp32_grad_for_sub_group): the gradient
        # partition is flattened (g bytes) and, for 16-bit gradients, copied to fp32 (m bytes) for the
        # optimizer; both are freed after the step. Measured on 2 CPU ranks in bf16: the first step
        # grows the process by 16.3-23.4 B per element, the Adam states' 8 plus the transient, of
        # which these 6 are accounted for; the rest is Adam scratch and allocator slack.
        transient = 0.0
        if stage == 3 and not setup.offload_optimizer:
            transient = shard * (g + m if g != m else g)
        for key, value in zip(("params", "grads", "master", "optimizer", "host", "step_transient"),
                              (w, gr, ms, op, host, transient)):
            sums[key] += value
        split.append(w + gr + ms + op)
    return StateEstimate(setup=setup, dense=split[0], expert=split[1], **sums)


# ---------------------------------------------------------------------------------------- activations

@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes one GPU keeps for backward, for one micro-batch. An *estimate*.

    Per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", eq. 1, 16-bit activations, no tensor/sequence parallelism): ``s*b*h*(34 + 5*a*s/h)``
    bytes, of which ``19*s*b*h`` is the 4h-GeLU MLP and ``5*a*s^2*b`` the attention scores. Here
    the attention part keeps ``s*b*h*15`` (+ the score term unless ``flash_attention``, which does
    not store the scores), and the MLP part is replaced by a top-k SwiGLU MoE's:
    ``k*s*b*(2*h + 8*f)`` (each routed copy saves its input and the gate, up, silu and product
    tensors of width f). The loss adds ``s*b*V*4`` (fp32 logits). With activation checkpointing a
    layer keeps only its input (``2*s*b*h``) and one layer's full activations are live at a time.
    fp32 activations double everything. All-to-all buffers and allocator fragmentation are not
    included: that is what the plan's headroom is for.
    """

    per_layer: float
    logits: float
    total: float
    formula: str


def estimate_activations(*, micro_batch: int, seq_len: int, hidden_size: int, num_layers: int,
                         num_heads: int, ffn_hidden_size: int, top_k: int, vocab_size: int,
                         precision: str = "bf16", flash_attention: bool = True,
                         activation_checkpointing: bool = False) -> ActivationEstimate:
    s, b, h, a, f, k = seq_len, micro_batch, hidden_size, num_heads, ffn_hidden_size, top_k
    scale = 2.0 if normalize_precision(precision) == "fp32" else 1.0
    attention = s * b * h * 15 + (0 if flash_attention else 5 * a * s * s * b)
    moe = k * s * b * (2 * h + 8 * f)
    per_layer = scale * (attention + moe)
    logits = 4.0 * s * b * vocab_size
    if activation_checkpointing:
        total = scale * 2 * s * b * h * num_layers + per_layer + logits
        formula = "L*2sbh (checkpointed inputs) + one layer's activations + 4sbV"
    else:
        total = per_layer * num_layers + logits
        formula = "L*(15sbh" + ("" if flash_attention else " + 5as^2b") + " + k*sb(2h+8f)) + 4sbV"
    return ActivationEstimate(per_layer=per_layer, logits=logits, total=total, formula=formula)


# ---------------------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Recommendation:
    setup: Setup | None
    estimate: StateEstimate | None
    reason: str

    @property
    def fits(self) -> bool:
        return self.setup is not None


@dataclass(frozen=True)
class Plan:
    """Per-GPU memory for every setup in :data:`LADDER`, and the inputs that produced it."""

    counts: ParamCounts
    num_gpus: int
    gpus_per_node: int
    gpu_memory_bytes: float
    precision: str
    ep_size: int
    optimizer_bytes: int
    estimates: dict[Setup, StateEstimate]
    activations: ActivationEstimate | None
    buffer_bytes: float
    headroom: float
    host_memory_bytes: float | None
    requested: Setup | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def usable_bytes(self) -> float:
        """Device memory a plan may fill: total minus ``headroom`` (allocator fragmentation,
        CUDA context, all-to-all and gather buffers the estimate does not itemise)."""
        return self.gpu_memory_bytes * (1 - self.headroom)

    def estimate(self, stage: int, offload_optimizer: bool = False, offload_parameters: bool = False) -> StateEstimate:
        for setup, est in self.estimates.items():
            if (setup.stage, setup.offload_optimizer, setup.offload_parameters) == (
                    stage, offload_optimizer, offload_parameters):
                return est
        raise KeyError(f"no setup stage={stage} offload_optimizer={offload_optimizer} "
                       f"offload_parameters={offload_parameters} in this plan")

    def device_bytes(self, setup: Setup) -> float:
        """Model states + activations (if estimated) + communication buckets, per GPU."""
        act = self.activations.total if self.activations else 0.0
        return self.estimates[setup].device_total + act + self.buffer_bytes

    def fits(self, setup: Setup) -> bool:
        if self.device_bytes(setup) > self.usable_bytes:
            return False
        if self.host_memory_bytes is not None:
            return self.estimates[setup].host * self.gpus_per_node <= self.host_memory_bytes
        return True

    def recommend(self) -> Recommendation:
        """The least aggressive setup that fits (stage 1 < 2 < 3 < offload), with the reason."""
        what = ("model states" + (" + activations" if self.activations else " (no activation estimate: "
                "pass micro_batch and seq_len)") + " + buckets")
        rejected = []
        for setup in sorted(self.estimates):
            need = self.device_bytes(setup)
            if self.fits(setup):
                reason = (f"{setup.label}: {_gb(need)} GB per GPU ({what}) of {_gb(self.usable_bytes)} GB usable "
                          f"({_gb(self.gpu_memory_bytes)} GB minus {self.headroom:.0%} headroom).")
                if rejected:
                    reason += " Less aggressive setups do not fit: " + "; ".join(rejected) + "."
                else:
                    reason += " It is the least aggressive setup, so nothing more is needed."
                host = self.estimates[setup].host
                if host:
                    reason += (f" Offload keeps {_gb(host)} GB per GPU ({_gb(host * self.gpus_per_node)} GB per "
                               f"node) in host memory; expect slower steps (PCIe traffic, CPU Adam).")
                return Recommendation(setup, self.estimates[setup], reason + self._about_requested(setup))
            if need > self.usable_bytes:
                rejected.append(f"{setup.label} needs {_gb(need)} GB")
            else:
                rejected.append(f"{setup.label} needs {_gb(self.estimates[setup].host * self.gpus_per_node)} GB "
                                f"of host memory per node, more than {_gb(self.host_memory_bytes or 0)} GB")
        return Recommendation(None, None, "Nothing fits: " + "; ".join(rejected) + ". Add GPUs, shorten the "
                              "sequence or micro-batch, use activation checkpointing, or add host memory.")

    def _about_requested(self, best: Setup) -> str:
        req = self.requested
        if req is None or req == best:
            return ""
        if req > best:
            return (f" You asked for {req.label}: more aggressive than needed; it only adds communication"
                    + (" and PCIe/CPU-Adam time" if req.offload_optimizer else "") + ".")
        return f" You asked for {req.label}, which does not fit ({_gb(self.device_bytes(req))} GB)."

    def table(self) -> str:
        """Markdown table, GB (10^9 bytes) per GPU."""
        act = self.activations.total if self.activations else 0.0
        rows = ["| setup | params | grads | fp32 master | optimizer | model states | + act. + buckets "
                "| host per GPU | fits |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for setup in sorted(self.estimates):
            e = self.estimates[setup]
            rows.append(f"| {setup.label} | {_gb(e.params)} | {_gb(e.grads)} | {_gb(e.master)} | {_gb(e.optimizer)} | "
                        f"{_gb(e.device_total)} | {_gb(e.device_total + act + self.buffer_bytes)} | {_gb(e.host)} | "
                        f"{'yes' if self.fits(setup) else 'no'} |")
        return "\n".join(rows)


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


def plan(model: Any = None, *, dense_params: int | None = None, expert_params: int | None = None,
         num_gpus: int, gpus_per_node: int | None = None, gpu_memory_bytes: float,
         precision: str = "bf16", ep_size: int = 1, stage: int | None = None, offload_optimizer: bool = False,
         offload_parameters: bool = False, micro_batch: int | None = None, seq_len: int | None = None,
         hidden_size: int | None = None, num_layers: int | None = None, num_heads: int | None = None,
         ffn_hidden_size: int | None = None, top_k: int | None = None, vocab_size: int | None = None,
         num_experts: int | None = None, flash_attention: bool = True, activation_checkpointing: bool = False,
         optimizer_bytes: int = 8, bucket_elements: int = 50_000_000, headroom: float = 0.10,
         host_memory_bytes: float | None = None, counts: ParamCounts | None = None,
         is_expert: Callable[[str], bool] = is_expert_param) -> Plan:
    """Per-GPU bytes for parameters, gradients, fp32 master weights and optimizer states under
    ZeRO 1/2/3 with and without offload, plus an activation estimate when ``micro_batch`` and
    ``seq_len`` are given (model sizes are read from ``model.config`` when possible).

    Give either ``model`` (any object with ``named_parameters()``; exact per-tensor rounding) or
    ``dense_params``/``expert_params`` totals. ``optimizer_bytes`` is per parameter (Adam: 8).
    ``stage``/``offload_optimizer``/``offload_parameters`` name the setup you intend
    (``Plan.requested``); every setup is estimated regardless, and :meth:`Plan.recommend` says
    whether yours is more aggressive than needed, or does not fit. ``headroom`` is the fraction of
    device memory kept free.
    """
    precision = normalize_precision(precision)
    if counts is None:
        if model is not None:
            counts = count_params(model, is_expert)
        elif dense_params is not None:
            counts = ParamCounts((int(dense_params),), (int(expert_params or 0),), exact=False)
        else:
            raise ValueError("plan() needs a model, or dense_params (and expert_params) counts")
    gpus_per_node = gpus_per_node or num_gpus
    if num_gpus < 1 or ep_size < 1 or num_gpus % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide num_gpus={num_gpus}")
    if num_experts is None and model is not None:
        cfg = getattr(model, "config", None)
        num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if num_experts and num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the number of experts ({num_experts})")
    notes = []
    if ep_size > gpus_per_node:
        notes.append(f"ep_size={ep_size} > {gpus_per_node} GPUs per node: the all-to-all crosses nodes.")
    if counts.expert_total and ep_size == 1 and num_gpus > 1:
        notes.append("ep_size=1: every GPU runs every expert; ZeRO still partitions expert states over all GPUs.")

    estimates = {s: _states(counts, s, num_gpus, ep_size, precision, optimizer_bytes) for s in LADDER}
    requested = None
    if stage is not None or offload_optimizer or offload_parameters:
        want = (3 if stage is None else stage, offload_optimizer or offload_parameters, offload_parameters)
        requested = next((s for s in LADDER if (s.stage, s.offload_optimizer, s.offload_parameters) == want), None)
        if requested is None:
            raise ValueError(f"no such setup: stage={want[0]}, offload_optimizer={want[1]}, "
                             f"offload_parameters={want[2]} (offload_parameters needs stage 3; the planner models "
                             "optimizer offload with stages 2 and 3)")

    activations = None
    if micro_batch and seq_len:
        cfg = getattr(model, "config", None)

        def pick(value: Any, *names: str) -> Any:
            if value is not None:
                return value
            for name in names:
                if getattr(cfg, name, None) is not None:
                    return getattr(cfg, name)
            raise ValueError(f"the activation estimate needs {names[0]} (pass it, or a model with .config)")

        activations = estimate_activations(
            micro_batch=micro_batch, seq_len=seq_len, hidden_size=pick(hidden_size, "hidden_size"),
            num_layers=pick(num_layers, "num_hidden_layers", "num_layers"),
            num_heads=pick(num_heads, "num_attention_heads", "num_heads"),
            ffn_hidden_size=pick(ffn_hidden_size, "intermediate_size", "moe_intermediate_size", "ffn_hidden_size"),
            top_k=pick(top_k, "num_experts_per_tok", "top_k"), vocab_size=pick(vocab_size, "vocab_size"),
            precision=precision, flash_attention=flash_attention,
            activation_checkpointing=activation_checkpointing)
    p, g, _ = _PRECISION_BYTES[precision]
    buffers = bucket_elements * (p + g)  # one reduce bucket (gradients) + one gather/prefetch bucket
    return Plan(counts=counts, num_gpus=num_gpus, gpus_per_node=gpus_per_node, gpu_memory_bytes=gpu_memory_bytes,
                precision=precision, ep_size=ep_size, optimizer_bytes=optimizer_bytes, estimates=estimates,
                activations=activations, buffer_bytes=float(buffers), headroom=headroom,
                host_memory_bytes=host_memory_bytes, requested=requested, notes=tuple(notes))


def choose_stage(model: Any, world_size: int, devices_per_node: int, ep_size: int, device_memory_bytes: float,
                 precision: str = "bf16", **plan_kwargs: Any) -> tuple[int, str]:
    """For ``ZeroMoEStrategy(stage="auto")``: the lowest ZeRO stage whose model states (plus any
    activation estimate the kwargs allow) fit, and why. Offload is never chosen silently: if even
    stage 3 does not fit, the answer is 3 and the reason says which offload setting would."""
    result = plan(model, num_gpus=world_size, gpus_per_node=devices_per_node, ep_size=ep_size,
                  gpu_memory_bytes=device_memory_bytes, precision=precision, **plan_kwargs)
    rec = result.recommend()
    if rec.setup is not None and not rec.setup.offload_optimizer:
        return rec.setup.stage, f"stage={rec.setup.stage} chosen by the memory planner. {rec.reason}"
    if rec.setup is not None:
        return 3, (f"stage=3 chosen, but it does not fit without offload; pass "
                   f"{', '.join(f'{k}=True' for k, v in rec.setup.strategy_kwargs().items() if v is True)} "
                   f"to fit. Planner: {rec.reason}")
    return 3, f"stage=3 chosen, but the planner finds no setup that fits. {rec.reason}"


# ---------------------------------------------------------------------------------------- CLI

#: The seeds' arithmetic (16 bytes per parameter, and ZeRO-1 "~1/4", ZeRO-2 "~1/8", ZeRO-3 "1/N").
def seed_estimate(total_params: int, num_gpus: int) -> dict[str, float]:
    base = 16 * total_params
    return {"no ZeRO": base, "ZeRO-1": base / 4, "ZeRO-2": base / 8, "ZeRO-3": base / num_gpus}


def mixtral_report(num_gpus: int = 8, gpu_memory_gb: float = 80, ep_sizes: tuple[int, ...] = (1, 8),
                   micro_batch: int = 1, seq_len: int = 4096) -> str:
    counts = moe_transformer_counts(**MIXTRAL_8X7B)
    cfg = MIXTRAL_8X7B
    lines = [f"Mixtral-8x7B: {counts.total:,} parameters = {counts.dense_total:,} dense (attention, norms, "
             f"routers, embeddings, lm_head) + {counts.expert_total:,} expert "
             f"(8 experts x 32 layers x 3 x 4096 x 14336). {num_gpus} x {gpu_memory_gb:g} GB, bf16, AdamW.", ""]
    for ep in ep_sizes:
        p = plan(counts=counts, num_gpus=num_gpus, gpus_per_node=num_gpus, gpu_memory_bytes=gpu_memory_gb * GB,
                 precision="bf16", ep_size=ep, micro_batch=micro_batch, seq_len=seq_len,
                 hidden_size=cfg["hidden_size"], num_layers=cfg["num_layers"], num_heads=cfg["num_heads"],
                 ffn_hidden_size=cfg["ffn_hidden_size"], top_k=2, vocab_size=cfg["vocab_size"],
                 activation_checkpointing=True)
        lines += [f"### ep_size={ep} (GB per GPU; activations {_gb(p.activations.total)} GB for micro-batch "
                  f"{micro_batch} x {seq_len} tokens with activation checkpointing, buckets {_gb(p.buffer_bytes)} GB)",
                  "", p.table(), "", "Recommendation: " + p.recommend().reason, ""]
    seed = seed_estimate(counts.total, num_gpus)
    lines += ["### The seeds' arithmetic applied to the same count",
              "", "| seeds' rule | GB per GPU |", "|---|---:|"]
    lines += [f"| {k} | {_gb(v)} |" for k, v in seed.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_zeromoe.planner", description=__doc__.split("\n")[0])
    parser.add_argument("--mixtral-8x7b", action="store_true", help="print the Mixtral-8x7B on 8x80 GB report")
    parser.add_argument("--dense", type=float, help="dense parameters (e.g. 1.6e9)")
    parser.add_argument("--experts", type=float, default=0, help="expert parameters, all experts (e.g. 45e9)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu-gb", type=float, default=80)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--ep-size", type=int, help="expert-parallel size (default: 1; with --config: every valid one)")
    from lightning_zeromoe.planner_cli import add_arguments, run_hf

    add_arguments(parser)  # --config / --model-type: plan a Hugging Face config (lightning_zeromoe.planner_cli)
    args = parser.parse_args(argv)
    if args.config or args.model_type:
        raise SystemExit(run_hf(args))
    if args.mixtral_8x7b or args.dense is None:
        print(mixtral_report(num_gpus=args.gpus, gpu_memory_gb=args.gpu_gb))
        return
    p = plan(dense_params=int(args.dense), expert_params=int(args.experts), num_gpus=args.gpus,
             gpus_per_node=args.gpus_per_node, gpu_memory_bytes=args.gpu_gb * GB, precision=args.precision,
             ep_size=args.ep_size or 1)
    print(p.table())
    print("\nRecommendation: " + p.recommend().reason)


if __name__ == "__main__":
    main()

__all__ = ["plan", "Plan", "Setup", "StateEstimate", "ActivationEstimate", "ParamCounts", "Recommendation",
           "choose_stage", "count_params", "moe_transformer_counts", "estimate_activations", "MIXTRAL_8X7B", "LADDER"]
