"""The plan: every setup's memory per rank, what fits, the recommendation, and stage='auto''s choice."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Callable

from lightning_zeromoe import knowledge
from lightning_zeromoe.planner.setups import GB, LADDER, Setup, _PRECISION_BYTES, normalize_precision
from lightning_zeromoe.planner.counts import (EXPERT_FFN_KEYS, EXPERT_KEYS, TOP_K_KEYS, ParamCounts, count_params,
                                             has_qk_norm, is_expert_param)
from lightning_zeromoe.planner.activations import ActivationEstimate, LatentAttention, estimate_activations
from lightning_zeromoe.planner.layers import LayerMix, layer_mix
from lightning_zeromoe.planner.memory import StateEstimate, _states
from lightning_zeromoe.planner.step_time import Hardware, StepTime, autoep_loop, expert_loop_of, format_seconds
from lightning_zeromoe.planner.counts import GatherUnit, gather_units
from lightning_zeromoe.planner.working_set import PeakEstimate, ZeroBuffers, estimate_peak


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
    #: Predicted seconds per optimizer step for every setup (:mod:`~lightning_zeromoe.planner.step_time`).
    step_times: dict[Setup, StepTime] = field(default_factory=dict)
    #: The model's ZeRO-3 gather units (when a model was given) and the bucket/threshold settings:
    #: with them and an activation estimate, :meth:`peak` models the step's working set.
    units: tuple[GatherUnit, ...] = ()
    zero_buffers: ZeroBuffers = field(default_factory=ZeroBuffers.strategy)

    def peak(self, setup: Setup) -> PeakEstimate | None:
        """Per-rank peak of the first and a steady step (:mod:`.working_set`), or None without a
        model's modules or without an activation estimate (micro_batch and seq_len)."""
        if not self.units or self.activations is None:
            return None
        acts = self.activations
        ckpt = acts.kept_per_layer != acts.per_layer
        return estimate_peak(self.units, setup, world=self.num_gpus, ep_size=self.ep_size, precision=self.precision,
                             buffers=self.zero_buffers, activation_logits=acts.logits,
                             optimizer_bytes=self.optimizer_bytes,
                             # checkpointed: each layer keeps its input; the largest one's recompute
                             activation_per_layer=acts.largest_layer if ckpt else acts.per_layer,
                             activation_kept_per_layer=acts.kept_per_layer if ckpt else None)

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
        """Model states + activations (if estimated) + communication buckets, per GPU; with a model
        and a batch shape, the modelled peak of the first or a steady step (:meth:`peak`)."""
        peak = self.peak(setup)
        if peak is not None:
            return max(peak.first.allocated, peak.steady.allocated)
        act = self.activations.total if self.activations else 0.0
        return self.estimates[setup].device_total + act + self.buffer_bytes

    @property
    def memory_basis(self) -> str:
        """What :meth:`device_bytes` counts, in words."""
        if self.units and self.activations is not None:
            return knowledge.message(_ENTRY, "basis-peak").render()
        if self.activations:
            return knowledge.message(_ENTRY, "basis-activations").render()
        return knowledge.message(_ENTRY, "basis-states").render(advice=knowledge.fix(_ENTRY, "pass-batch-shape").render())

    def fits(self, setup: Setup) -> bool:
        if self.device_bytes(setup) > self.usable_bytes:
            return False
        if self.host_memory_bytes is not None:
            return self.estimates[setup].host * self.gpus_per_node <= self.host_memory_bytes
        return True

    def recommend(self, on_device_only: bool = False) -> Recommendation:
        """The fastest setup that fits (predicted step time, :attr:`step_times`); among equal times
        the least aggressive (stage 1 < 2 < 3 < offload). The reason gives its memory per GPU, its
        predicted step time and the runner-up's. ``on_device_only``: offload setups are not candidates."""
        what = self.memory_basis
        rejected, fitting = [], []
        for setup in sorted(self.estimates):
            if on_device_only and setup.offload_optimizer:
                continue
            need = self.device_bytes(setup)
            if self.fits(setup):
                fitting.append(setup)
            elif need > self.usable_bytes:
                rejected.append(knowledge.message(_ENTRY, "needs-device").render(label=setup.label, need=_gb(need)))
            else:
                rejected.append(knowledge.message(_ENTRY, "needs-host").render(
                    label=setup.label, need=_gb(self.estimates[setup].host * self.gpus_per_node),
                    host=_gb(self.host_memory_bytes or 0)))
        if not fitting:
            return Recommendation(None, None, knowledge.compose(_ENTRY, "nothing-fits", "more-memory",
                                                                rejected="; ".join(rejected)))
        ranked = fastest_first(fitting, self.step_times)
        setup = ranked[0]
        reason = knowledge.message(_ENTRY, "chosen").render(
            label=setup.label, need=_gb(self.device_bytes(setup)), basis=what, usable=_gb(self.usable_bytes),
            total=_gb(self.gpu_memory_bytes), headroom=f"{self.headroom:.0%}")
        if setup in self.step_times:
            reason += ", " + knowledge.message(_ENTRY, "step").render(step=self.step_time_text(setup))
        if len(ranked) > 1:
            other = ranked[1]
            tie = (other in self.step_times and setup in self.step_times
                   and self.step_times[other].total <= self.step_times[setup].total * (1 + _TIE))
            reason += "; " + knowledge.message(_ENTRY, "runner-up").render(
                label=other.label, need=_gb(self.device_bytes(other)),
                step=f", {format_seconds(self.step_times[other].total)}" if other in self.step_times else "",
                tie=" " + knowledge.message(_ENTRY, "tie").render() if tie else "")
        else:
            reason += "; " + knowledge.message(_ENTRY, "only-fit").render()
        if rejected:
            reason += " " + knowledge.message(_ENTRY, "not-fitting").render(rejected="; ".join(rejected))
        host = self.estimates[setup].host
        if host:
            reason += " " + knowledge.message(_ENTRY, "offload-host").render(
                per_gpu=_gb(host), per_node=_gb(host * self.gpus_per_node))
        return Recommendation(setup, self.estimates[setup], reason + self._about_requested(setup))

    def step_time_text(self, setup: Setup) -> str:
        """``1.23 s (compute 0.80 s, comm 0.40 s, offload 0.03 s)``: :meth:`StepTime.describe`."""
        return self.step_times[setup].describe()

    def _about_requested(self, best: Setup) -> str:
        req = self.requested
        if req is None or req == best:
            return ""
        if not self.fits(req):
            return " " + knowledge.message(_ENTRY, "requested-no-fit").render(
                label=req.label, need=_gb(self.device_bytes(req)))
        if req in self.step_times and best in self.step_times:
            return " " + knowledge.message(_ENTRY, "requested-slower").render(
                label=req.label, requested=format_seconds(self.step_times[req].total),
                best=format_seconds(self.step_times[best].total),
                offload=(" " + knowledge.message(_ENTRY, "requested-offload-time").render()
                         if req.offload_optimizer else ""))
        return " " + knowledge.message(_ENTRY, "requested-fits").render(label=req.label, best=best.label)

    def table(self) -> str:
        """Markdown table, GB (10^9 bytes) per GPU; the last memory column is :meth:`device_bytes`."""
        rows = ["| setup | params | grads | fp32 master | optimizer | model states | "
                + ("peak" if self.units and self.activations is not None else "+ act. + buckets") + " "
                "| host per GPU | fits |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for setup in sorted(self.estimates):
            e = self.estimates[setup]
            rows.append(f"| {setup.label} | {_gb(e.params)} | {_gb(e.grads)} | {_gb(e.master)} | {_gb(e.optimizer)} | "
                        f"{_gb(e.device_total)} | {_gb(self.device_bytes(setup))} | {_gb(e.host)} | "
                        f"{'yes' if self.fits(setup) else 'no'} |")
        return "\n".join(rows)


#: The knowledge-base entry every reason and piece of advice of the planner is rendered from.
_ENTRY = "planner-recommendation"


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


#: Predicted times within this relative difference are a tie (then the less aggressive setup wins).
_TIE = 1e-9


def fastest_first(setups: list[Setup], times: dict[Setup, StepTime]) -> list[Setup]:
    """Setups by predicted step time, ties (and setups without a prediction) by the ladder's order."""
    if not all(s in times for s in setups):
        return sorted(setups)
    best = min(times[s].total for s in setups)
    return sorted(setups, key=lambda s: (max(best * (1 + _TIE), times[s].total), s))


def _step_times(model: Any, counts: ParamCounts, *, world: int, gpus_per_node: int, ep_size: int, precision: str,
                top_k: int | None, hidden_size: int | None, num_layers: int | None, num_heads: int | None,
                num_experts: int | None, micro_batch: int | None, seq_len: int | None, accumulation: int,
                bucket_elements: int, activation_checkpointing: bool, hardware: Hardware,
                moe_layers: int | None, is_expert: Callable[[str], bool], expert_loop: str) -> dict[Setup, StepTime]:
    """Predicted step time of every ladder setup (compute only when micro_batch and seq_len are given)."""
    from lightning_zeromoe.planner.comm import CommShape
    from lightning_zeromoe.planner.step_time import ModelShape, autoep_loop, setup_step_time

    cfg = getattr(model, "config", None)

    def read(value: Any, *names: str) -> Any:
        for name in names if value is None else ():
            if isinstance(getattr(cfg, name, None), int):
                return getattr(cfg, name)
        return value

    hidden = read(hidden_size, "hidden_size") or 0
    layers = read(num_layers, "num_hidden_layers", "num_layers") or 0
    order = None
    if model is not None and counts.exact:
        order = tuple((int(p.numel()), is_expert(n), n.rpartition(".")[0]) for n, p in model.named_parameters()
                      if getattr(p, "requires_grad", True))
    tokens = (micro_batch or 0) * (seq_len or 0)
    shape = CommShape(counts=counts, stage=1, world=world, ep_size=ep_size, precision=precision,
                      top_k=read(top_k, "num_experts_per_tok", "top_k") or 1, hidden_size=hidden,
                      moe_layers=moe_layers if moe_layers is not None else layers,
                      num_experts=num_experts or 0, tokens_per_micro_batch=tokens, accumulation=accumulation,
                      reduce_bucket_size=bucket_elements or 50_000_000, allgather_bucket_size=bucket_elements or 50_000_000,
                      activation_checkpointing=activation_checkpointing, param_order=order)
    shapes = ModelShape(attention_layers=layers, seq_len=seq_len or 0, expert_loop=expert_loop,
                        autoep_expert_loop=autoep_loop(precision))
    del num_heads  # attention width = hidden size (heads x head size) for the models planned here
    return {s: setup_step_time(shape, s, hardware, model=shapes, gpus_per_node=gpus_per_node) for s in LADDER}


def plan(model: Any = None, *, dense_params: int | None = None, expert_params: int | None = None,
         num_gpus: int, gpus_per_node: int | None = None, gpu_memory_bytes: float,
         precision: str = "bf16", ep_size: int = 1, stage: int | None = None, offload_optimizer: bool = False,
         offload_parameters: bool = False, micro_batch: int | None = None, seq_len: int | None = None,
         hidden_size: int | None = None, num_layers: int | None = None, num_heads: int | None = None,
         ffn_hidden_size: int | None = None, top_k: int | None = None, vocab_size: int | None = None,
         num_experts: int | None = None, flash_attention: bool = True, activation_checkpointing: bool = False,
         optimizer_bytes: int = 8, bucket_elements: int = 50_000_000, headroom: float = 0.10,
         host_memory_bytes: float | None = None, counts: ParamCounts | None = None,
         is_expert: Callable[[str], bool] = is_expert_param, hardware: Hardware | None = None,
         accumulation: int = 1, moe_layers: int | None = None, zero_config: dict[str, Any] | None = None,
         units: tuple[GatherUnit, ...] | None = None, num_kv_heads: int | None = None,
         head_dim: int | None = None, qk_norm: bool | None = None, expert_loop: str | None = None,
         mix: LayerMix | None = None, latent_attention: LatentAttention | None = None) -> Plan:
    """Per-GPU bytes for parameters, gradients, fp32 master weights and optimizer states under
    ZeRO 1/2/3 with and without offload, plus an activation estimate when ``micro_batch`` and
    ``seq_len`` are given (model sizes are read from ``model.config`` when possible).

    Give either ``model`` (any object with ``named_parameters()``; exact per-tensor rounding) or
    ``dense_params``/``expert_params`` totals. ``optimizer_bytes`` is per parameter (Adam: 8).
    ``stage``/``offload_optimizer``/``offload_parameters`` name the setup you intend
    (``Plan.requested``); every setup is estimated regardless, and :meth:`Plan.recommend` says
    whether yours is more aggressive than needed, or does not fit. ``headroom`` is the fraction of
    device memory kept free. ``hardware`` (default: H100/H200-class, :class:`Hardware`),
    ``accumulation`` and ``moe_layers`` feed the predicted step time of every setup
    (:attr:`Plan.step_times`), by which :meth:`Plan.recommend` chooses. ``num_kv_heads``, ``head_dim``
    and ``qk_norm`` shape the attention's activations (read from the model when not given);
    ``expert_loop`` is how the model's own blocks run their experts (default: read from the model,
    :func:`~lightning_zeromoe.planner.step_time.expert_loop_of`); ``mix``: the dense layers and
    shared experts beside the MoE blocks (default: read from the model, :func:`.layers.layer_mix`),
    for the activations and, unless ``moe_layers`` is given, the layers that run an all-to-all;
    ``latent_attention``: multi-head latent attention's widths (default: read from ``model.config``).
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
        num_experts = next((getattr(cfg, key) for key in EXPERT_KEYS if isinstance(getattr(cfg, key, None), int)), None)
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

    expert_loop = expert_loop or expert_loop_of(model)
    cfg = getattr(model, "config", None)
    if mix is None and model is not None:
        mix = layer_mix(model, hidden_size or getattr(cfg, "hidden_size", 0),
                        num_layers or getattr(cfg, "num_hidden_layers", 0) or 0)
    if moe_layers is None and mix is not None:
        moe_layers = mix.moe_layers
    mix = mix or LayerMix(moe_layers=0)
    activations = None
    if micro_batch and seq_len:
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
            ffn_hidden_size=pick(ffn_hidden_size, *EXPERT_FFN_KEYS), top_k=pick(top_k, *TOP_K_KEYS),
            vocab_size=pick(vocab_size, "vocab_size"), precision=precision, flash_attention=flash_attention,
            activation_checkpointing=activation_checkpointing,
            num_kv_heads=num_kv_heads or getattr(cfg, "num_key_value_heads", None),
            head_dim=head_dim or getattr(cfg, "head_dim", None),
            qk_norm=has_qk_norm(model) if qk_norm is None else qk_norm, num_experts=num_experts or 0,
            ep_size=ep_size, expert_loop=expert_loop if ep_size == 1 else autoep_loop(precision),
            dense_layers=mix.dense_layers, dense_ffn=mix.dense_ffn, shared_ffn=mix.shared_ffn,
            shared_gate=mix.shared_gate, latent_attention=latent_attention or LatentAttention.of(cfg))
    units = tuple(units or ())
    if not units and model is not None and hasattr(model, "named_modules"):
        # At ep_size=1 the strategy registers each MoE block (a module with an ``experts`` child) as a leaf.
        units = gather_units(model, lambda name, module: ep_size == 1 and hasattr(module, "experts"), is_expert)
    zero_buffers = (ZeroBuffers.from_config(zero_config) if zero_config else
                    dataclasses.replace(ZeroBuffers.strategy(), reduce_bucket_size=bucket_elements,
                                        allgather_bucket_size=bucket_elements))
    p, g, _ = _PRECISION_BYTES[precision]
    buffers = bucket_elements * (p + g)  # one reduce bucket (gradients) + one gather/prefetch bucket
    times = _step_times(model, counts, world=num_gpus, gpus_per_node=gpus_per_node, ep_size=ep_size,
                        precision=precision, top_k=top_k, hidden_size=hidden_size, num_layers=num_layers,
                        num_heads=num_heads, num_experts=num_experts, micro_batch=micro_batch, seq_len=seq_len,
                        accumulation=accumulation, bucket_elements=bucket_elements,
                        activation_checkpointing=activation_checkpointing, hardware=hardware or Hardware(),
                        moe_layers=moe_layers, is_expert=is_expert, expert_loop=expert_loop)
    return Plan(counts=counts, num_gpus=num_gpus, gpus_per_node=gpus_per_node, gpu_memory_bytes=gpu_memory_bytes,
                precision=precision, ep_size=ep_size, optimizer_bytes=optimizer_bytes, estimates=estimates,
                activations=activations, buffer_bytes=float(buffers), headroom=headroom,
                host_memory_bytes=host_memory_bytes, requested=requested, notes=tuple(notes), step_times=times,
                units=units, zero_buffers=zero_buffers)


def choose_stage(model: Any, world_size: int, devices_per_node: int, ep_size: int, device_memory_bytes: float,
                 precision: str = "bf16", **plan_kwargs: Any) -> tuple[int, str]:
    """For ``ZeroMoEStrategy(stage="auto")``: the ZeRO stage whose predicted step time is the
    shortest among those whose memory fits (ties: the lower stage), and why (memory per rank,
    predicted step time, the runner-up). Offload is never chosen silently: if no stage fits on the
    device, the answer is 3 and the reason says which offload setting would. A model built under
    ``zero.Init`` (in ``configure_model``) is already partitioned: it keeps stage 3."""
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        return 3, knowledge.message(_ENTRY, "auto-partitioned").render()
    result = plan(model, num_gpus=world_size, gpus_per_node=devices_per_node, ep_size=ep_size,
                  gpu_memory_bytes=device_memory_bytes, precision=precision, **plan_kwargs)
    on_device = result.recommend(on_device_only=True)
    if on_device.setup is not None:
        return on_device.setup.stage, knowledge.message(_ENTRY, "auto-chosen").render(
            stage=on_device.setup.stage, reason=on_device.reason)
    rec = result.recommend()
    if rec.setup is not None:
        flags = ", ".join(f"{k}=True" for k, v in rec.setup.strategy_kwargs().items() if v is True)
        return 3, knowledge.message(_ENTRY, "auto-needs-offload").render(
            advice=knowledge.fix(_ENTRY, "pass-offload").render(flags=flags), reason=rec.reason)
    return 3, knowledge.message(_ENTRY, "auto-no-fit").render(reason=rec.reason)
