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

Pure package: no torch, DeepSpeed or Lightning import at module level (a model, if given, is only
iterated with ``named_parameters()``), so ``zeromoe-plan --dense ...`` and ``--mixtral-8x7b`` are instant.

Where things are: :mod:`.setups` (precisions, the stage x offload ladder), :mod:`.counts` (dense vs
expert parameters), :mod:`.memory` (per-rank model states), :mod:`.activations` (what the forward keeps for backward), :mod:`.plan` (the table,
the recommendation, ``stage="auto"``, ``ep_size="auto"``), :mod:`.comm` (bytes per step by collective
and group), :mod:`.step_time` (predicted seconds per step, by which the recommendation chooses),
:mod:`.native_ep` (the peer's layout: transformers' FSDP2 + EP, per GPU and per step), :mod:`.model_facts`
(what is read from a Hugging Face config), :mod:`.rows` (every setup's row, the ranking, the table),
:mod:`.native_report` (``--compare-native``), and :mod:`.cli` (the ``zeromoe-plan`` command, ``python -m lightning_zeromoe.planner``; also from a Hugging Face
config; ``--compare-native``).
"""

from lightning_zeromoe.planner.counts import MIXTRAL_8X7B, ParamCounts, count_params, is_expert_param, moe_transformer_counts
from lightning_zeromoe.planner.activations import ActivationEstimate, estimate_activations
from lightning_zeromoe.planner.layers import LayerMix, layer_mix
from lightning_zeromoe.planner.memory import StateEstimate
from lightning_zeromoe.planner.auto import choose_ep_size, choose_setup
from lightning_zeromoe.planner.plan import Plan, Recommendation, choose_stage, plan
from lightning_zeromoe.planner.reports import mixtral_report, seed_estimate
from lightning_zeromoe.planner.step_time import Hardware, Link, StepTime, predict_step_time
from lightning_zeromoe.planner.setups import GB, GIB, LADDER, Setup, normalize_precision

__all__ = ["GB", "GIB", "LADDER", "MIXTRAL_8X7B", "ActivationEstimate", "ParamCounts", "Plan", "Recommendation", "Setup",
           "StateEstimate", "choose_stage", "choose_ep_size", "choose_setup", "Hardware", "Link", "StepTime",
           "predict_step_time", "count_params", "estimate_activations", "is_expert_param", "LayerMix", "layer_mix",
           "mixtral_report", "moe_transformer_counts", "normalize_precision", "plan", "seed_estimate"]
