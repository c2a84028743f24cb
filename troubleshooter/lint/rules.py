"""Rules about what the settings mean: batch arithmetic, precision, offload, buckets, expert
parallelism, 16-bit saving, and the seeds' "moe" block (which nothing reads, so nothing in it is
treated as live config)."""

from __future__ import annotations

import json
from dataclasses import replace

from troubleshooter import knowledge
from troubleshooter.knowledge import Message
from troubleshooter.lint.context import Context, get, is_int, nested

__all__ = ["RULES"]

#: Bucket sizes (elements) outside this range are flagged; see the bucket-size-range entry.
BUCKET_MIN, BUCKET_MAX = 1_000_000, 1_000_000_000
#: Message of the moe-config-block-ignored entry that says where each key of the block belongs.
MOE_NOTES = {
    "enabled": "note-enabled", "enable": "note-enabled", "ep_size": "note-ep-size",
    "num_experts": "note-num-experts", "top_k": "note-top-k", "k": "note-top-k",
    "min_capacity": "note-capacity", "capacity_factor": "note-capacity",
    "eval_capacity_factor": "note-capacity", "drop_tokens": "note-drop-tokens",
    "noisy_gate_policy": "note-noisy-gate-policy",
    "load_balance_loss_weight": "note-load-balance-loss-weight", "use_tutel": "note-use-tutel",
}


def _autoep_zero3(ctx: Context) -> bool:
    return ctx.int_at("zero_optimization.stage") == 3 and ctx.enabled("expert_parallel.enabled")


def _says_moe(block: dict) -> bool:
    """Whether the block describes an MoE model: not switched off, and experts or EP given."""
    for key in ("enabled", "enable"):
        if key in block:
            return block[key] is True
    experts = block.get("num_experts")
    counts = experts if isinstance(experts, list) else [experts]
    return any(is_int(c) and c > 1 for c in counts) or "ep_size" in block


def _ep_note(ctx: Context, block: dict) -> Message | None:
    """ep_size must divide the number of experts and the world size wherever it is moved to."""
    ep = block.get("ep_size")
    if not is_int(ep) or ep < 1:
        return None
    experts = block.get("num_experts")
    counts = [int(c) for c in (experts if isinstance(experts, list) else [experts]) if is_int(c) and c > 0]
    world = ctx.world_size
    broken = [f"the number of experts ({c})" for c in dict.fromkeys(counts) if c % ep]
    if world is not None and world % ep:
        broken.append(f"the world size ({world})")
    if not broken:
        return None
    known = counts + ([world] if world is not None else [])
    valid = [d for d in range(1, min(known) + 1) if all(n % d == 0 for n in known)]
    note = knowledge.message("moe-config-block-ignored", "note-ep-size-divides")
    return replace(note, text=note.render(key="ep_size", value=json.dumps(ep),
                                          what=", nor ".join(broken), valid=valid))


def moe_block(ctx: Context) -> None:
    """The seeds' "moe" block: DeepSpeed ignores it. One finding; a note per key, and the two
    facts that stay true wherever the keys are moved (fp16 on an MoE model; an ep_size that does
    not divide the experts or the world size)."""
    block = ctx.config.get("moe")
    if block is None:
        return
    items = block.items() if isinstance(block, dict) else ()
    notes = []
    for key, value in items:
        note = knowledge.message("moe-config-block-ignored", MOE_NOTES.get(key, "note-unknown"))
        notes.append(replace(note, text=note.render(key=key, value=json.dumps(value))))
    if isinstance(block, dict):
        if ctx.enabled("fp16.enabled") and _says_moe(block):
            notes.append(knowledge.message("moe-config-block-ignored", "note-fp16"))
        if (ep_note := _ep_note(ctx, block)) is not None:
            notes.append(ep_note)
    notes = tuple(notes)
    ep = block.get("ep_size") if isinstance(block, dict) else None
    if ctx.int_at("zero_optimization.stage") == 3:
        patch = {"moe": None, "expert_parallel": {"enabled": True, "autoep_size":
                                                  ep if isinstance(ep, int) and ep > 0 else 1}}
        ctx.add("warning", "moe", knowledge.message("moe-config-block-ignored", "block-stage3"),
                knowledge.fix("moe-config-block-ignored", "stage3-use-autoep"), patch=patch,
                notes=notes, count=len(notes))
    else:
        ctx.add("warning", "moe", knowledge.message("moe-config-block-ignored", "block"),
                knowledge.fix("moe-config-block-ignored", "stage12-native-moe-args"),
                patch={"moe": None}, notes=notes, count=len(notes))


def _derive(tbs: int | None, micro: int | None, acc: int | None, world: int) -> dict[str, int]:
    """DeepSpeedConfig._set_batch_related_parameters (0.19.8): the missing values, with its
    integer divisions."""
    if tbs is not None and micro is not None and acc is None:
        return {"gradient_accumulation_steps": tbs // micro // world}
    if tbs is not None and acc is not None and micro is None:
        return {"train_micro_batch_size_per_gpu": tbs // world // acc}
    if tbs is not None and micro is None and acc is None:
        return {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": tbs // world}
    return {}


def _suggest(tbs: int, micro: int | None, acc: int | None, world: int) -> tuple[int, int] | None:
    """(micro, accumulation) with tbs = micro x acc x world: keep the given accumulation when it
    fits (as DeepSpeed derives the micro batch), else the largest micro batch <= the given one."""
    if tbs % world:
        return None
    per_rank = tbs // world
    if acc is not None and acc > 0 and per_rank % acc == 0:
        return per_rank // acc, acc
    start = min(micro or per_rank, per_rank) if (micro or 0) > 0 else per_rank
    best = next(m for m in range(start, 0, -1) if per_rank % m == 0)
    return best, per_rank // best


def batch_arithmetic(ctx: Context) -> None:
    """train_batch_size = micro x accumulation x world size, as DeepSpeed derives and asserts it."""
    tbs = ctx.int_at("train_batch_size")
    micro = ctx.int_at("train_micro_batch_size_per_gpu")
    acc = ctx.int_at("gradient_accumulation_steps")
    if ctx.consumer == "lightning":
        acc = None  # Lightning writes it from Trainer(accumulate_grad_batches=...)
        if tbs is not None:
            ctx.add("info", "train_batch_size", knowledge.message("batch-arithmetic", "lightning-total"),
                    knowledge.fix("batch-arithmetic", "lightning-omit-train-batch"), tbs=tbs)
        return
    if ctx.world_size is not None:
        _batch_with_world(ctx, tbs, micro, acc, ctx.world_size)
    elif tbs is not None and acc is not None:
        _batch_without_world(ctx, tbs, micro, acc)


def _batch_with_world(ctx: Context, tbs: int | None, micro: int | None, acc: int | None,
                      world: int) -> None:
    if tbs is None:
        return  # DeepSpeed derives train_batch_size: nothing can disagree
    derived = _derive(tbs, micro, acc, world)
    micro_eff = derived.get("train_micro_batch_size_per_gpu", micro)
    acc_eff = derived.get("gradient_accumulation_steps", acc)
    if micro_eff > 0 and acc_eff > 0 and tbs == micro_eff * acc_eff * world:
        return
    suggestion = _suggest(tbs, micro, acc, world)
    if suggestion:
        good_micro, good_acc = suggestion
        fix = knowledge.fix("batch-arithmetic", "set-micro-and-accumulation")
        patch = {k: v for k, v, given in (("train_micro_batch_size_per_gpu", good_micro, micro),
                                           ("gradient_accumulation_steps", good_acc, acc)) if v != given}
    else:
        good_micro = good_acc = None
        fix, patch = knowledge.fix("batch-arithmetic", "set-all-three"), None
    values = dict(tbs=tbs, world=world, good_micro=good_micro, good_acc=good_acc)
    if "gradient_accumulation_steps" in derived and derived["gradient_accumulation_steps"] < 1:
        ctx.add("error", "train_batch_size", knowledge.message("batch-arithmetic", "accumulation-not-whole"),
                fix, patch=patch, micro=micro, exact=f"{tbs / (micro * world):g}",
                floor=derived["gradient_accumulation_steps"], **values)
    elif "train_micro_batch_size_per_gpu" in derived and derived["train_micro_batch_size_per_gpu"] < 1:
        ctx.add("error", "train_batch_size", knowledge.message("batch-arithmetic", "micro-not-whole"),
                fix, patch=patch, acc=acc_eff, exact=f"{tbs / (acc_eff * world):g}",
                floor=derived["train_micro_batch_size_per_gpu"], **values)
    else:
        ctx.add("error", "train_batch_size", knowledge.message("batch-arithmetic", "mismatch"),
                fix, patch=patch, micro=micro_eff, acc=acc_eff, **values)


def _batch_without_world(ctx: Context, tbs: int, micro: int | None, acc: int) -> None:
    if micro is not None:
        if micro < 1 or acc < 1 or tbs % (micro * acc):
            ctx.add("error", "train_batch_size", knowledge.message("batch-arithmetic", "no-world-fits"),
                    knowledge.fix("batch-arithmetic", "set-all-three"), tbs=tbs,
                    product=micro * acc)
            return
        ctx.add("info", "train_batch_size", knowledge.message("batch-arithmetic", "one-world-fits"),
                knowledge.fix("batch-arithmetic", "run-lint"), tbs=tbs, micro=micro, acc=acc,
                world=tbs // (micro * acc))
        return
    if acc < 1:
        return
    worlds = [w for w in range(1, tbs + 1) if tbs % (w * acc) == 0]
    ctx.add("info", "train_batch_size", knowledge.message("batch-arithmetic", "worlds-fit"),
            knowledge.fix("batch-arithmetic", "run-lint"), tbs=tbs, acc=acc, worlds=worlds)


def fp16_moe(ctx: Context) -> None:
    fp16, bf16 = ctx.enabled("fp16.enabled"), ctx.enabled("bf16.enabled")
    if fp16 and bf16:
        ctx.add("error", "fp16.enabled", knowledge.message("fp16-moe", "both-enabled"),
                knowledge.fix("fp16-moe", "use-bf16"), patch={"fp16": {"enabled": False}})
    elif fp16 and ctx.enabled("expert_parallel.enabled"):
        ctx.add("warning", "fp16.enabled", knowledge.message("fp16-moe", "fp16-with-moe"),
                knowledge.fix("fp16-moe", "use-bf16"),
                patch={"fp16": {"enabled": False}, "bf16": {"enabled": True}})


def offload(ctx: Context) -> None:
    stage = ctx.int_at("zero_optimization.stage")
    for part in ("offload_optimizer", "offload_param"):
        path = f"zero_optimization.{part}"
        device = get(ctx.config, f"{path}.device")
        if device not in ("cpu", "nvme"):
            continue
        pinned = get(ctx.config, f"{path}.pin_memory") is True
        message = knowledge.message("offload-last-resort", "offload-pinned" if pinned else "offload")
        ctx.add("info", f"{path}.device", message,
                knowledge.fix("offload-last-resort", "offload-optimizer-only"),
                patch=nested({f"{path}.device": "none"}), part=part, device=device)
        if part == "offload_param" and stage is not None and stage != 3:
            ctx.add("warning", f"{path}.device", knowledge.message("offload-last-resort", "param-below-stage3"),
                    knowledge.fix("offload-last-resort", "remove-offload-param"),
                    patch=nested({path: None}), stage=stage)


def stage3_overlap(ctx: Context) -> None:
    if ctx.int_at("zero_optimization.stage") != 3:
        return
    for key in ("overlap_comm", "contiguous_gradients"):
        if get(ctx.config, f"zero_optimization.{key}") is False:
            ctx.add("warning", f"zero_optimization.{key}", knowledge.message("zero3-overlap-comm", "off"),
                    knowledge.fix("zero3-overlap-comm", "enable-overlap"),
                    patch=nested({f"zero_optimization.{key}": True}))


def ep_divisibility(ctx: Context) -> None:
    world, autoep = ctx.world_size, ctx.int_at("expert_parallel.autoep_size")
    if autoep is not None and world is not None and (autoep < 1 or world % autoep):
        ctx.add("error", "expert_parallel.autoep_size",
                knowledge.message("ep-size-divisibility", "autoep-world"),
                knowledge.fix("ep-size-divisibility", "pick-common-divisor"), autoep=autoep,
                world=world, valid=[d for d in range(1, world + 1) if world % d == 0])


#: Lower bounds of DeepSpeedZeroConfig (runtime/zero/config.py, 0.19.8): reduce_bucket_size is
#: Field(gt=0); the others ge=0.
_BUCKET_GT_ZERO = {"reduce_bucket_size"}


def bucket_sizes(ctx: Context) -> None:
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "prefetch_bucket_size"):
        path = f"zero_optimization.{key}"
        value = get(ctx.config, path)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value == 0 and "prefetch" in key:
            ctx.add("info", path, knowledge.message("bucket-size-range", "prefetch-zero"),
                    knowledge.fix("bucket-size-range", "use-defaults"))
        elif value < 0 or (value == 0 and key in _BUCKET_GT_ZERO):
            ctx.add("error", path, knowledge.message("bucket-size-range", "refused"),
                    knowledge.fix("bucket-size-range", "use-defaults"),
                    patch=nested({path: 50_000_000}), bound="> 0" if key in _BUCKET_GT_ZERO else ">= 0")
        elif value < BUCKET_MIN or value > BUCKET_MAX:
            message = knowledge.message("bucket-size-range", "too-small" if value < BUCKET_MIN else "too-large")
            ctx.add("warning", path, message, knowledge.fix("bucket-size-range", "keep-in-range"),
                    patch=nested({path: 50_000_000}), size=f"{value:g}", low=f"{BUCKET_MIN:g}",
                    high=f"{BUCKET_MAX:g}")


def gather_on_save(ctx: Context) -> None:
    """Under AutoEP + ZeRO-3 save_16bit_model raises whatever the flag says (an error); under
    plain ZeRO-3 the flag works but gathers the whole model on every save (information)."""
    if ctx.int_at("zero_optimization.stage") != 3:
        return
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        path = f"zero_optimization.{key}"
        if get(ctx.config, path) is not True:
            continue
        if _autoep_zero3(ctx):
            ctx.add("error", path, knowledge.message("gather-16bit-on-save", "autoep-zero3"),
                    knowledge.fix("gather-16bit-on-save", "use-zeromoe-export"),
                    patch=nested({path: None}))
        else:
            ctx.add("info", path, knowledge.message("gather-16bit-on-save", "gathers-whole-model"),
                    knowledge.fix("gather-16bit-on-save", "keep-false-save-sharded"),
                    patch=nested({path: False}))


def load_balance_coeff(ctx: Context) -> None:
    block = ctx.config.get("expert_parallel")
    if isinstance(block, dict) and block.get("load_balance_coeff") is not None:
        ctx.add("error", "expert_parallel.load_balance_coeff",
                knowledge.message("autoep-load-balance-coeff", "refused"),
                knowledge.fix("autoep-load-balance-coeff", "remove-load-balance-coeff"),
                patch={"expert_parallel": {"load_balance_coeff": None}})


RULES = (moe_block, batch_arithmetic, fp16_moe, offload, stage3_overlap, ep_divisibility,
         bucket_sizes, gather_on_save, load_balance_coeff)
