"""Out of memory, GPU (``cuda-oom``) or host RAM (``cpu-oom``): the knowledge base's ladder.

GPU: read the numbers of the user's own message (allocated vs reserved says whether it is
fragmentation); micro-batch down with accumulation up; activation checkpointing; ZeRO stage up;
offload last. Host RAM: confirm it is host memory, build the model partitioned, keep less on the
host, then the same micro-batch and checkpointing rungs. The "Try it" rungs run the tiny MoE in a
child process under a kernel-enforced memory limit (:mod:`troubleshooter.repro.memory`); every
rung is measured the same way, without the limit and under it, and the walkthrough says that this
is the example model, not the user's run.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from troubleshooter import knowledge
from troubleshooter.walkthroughs.base import Outcome, Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.checks import doctor_check, lint_check
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import config_diff, merge_patch, text_diff

__all__ = ["OOM_CONFIG", "oom_walkthrough"]

#: The example config shown when the notebook holds none (the tiny reproduction's settings).
OOM_CONFIG = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}

_EXAMPLE_RUN = "the example tiny MoE on this CPU (not your run)"


def _ladder_try(before: int, after: int) -> Callable[[], TryResult]:
    """Rung ``before`` vs rung ``after`` of the tiny model's ladder, each measured without and under the limit."""
    def run() -> TryResult:
        from troubleshooter.repro import oom

        result = oom()
        a, b = result.rungs[before], result.rungs[after]

        def nums(r: Any) -> dict:
            return {"micro-batch x accumulation": r.batch, "activation checkpointing": r.checkpointing,
                    "needs MiB (no limit)": r.needs_mb, "limit MiB": result.budget_mb,
                    "under the limit": result.outcome(r), "loss of the step (no limit)": f"{r.loss:.4f}"}

        same = abs(a.loss - b.loss) < 1e-3
        note = (f"Measured on {_EXAMPLE_RUN}: one optimizer step, a {result.budget_mb:g} MiB limit above the "
                f"built model. Loss {a.loss:.4f} vs {b.loss:.4f}: "
                + ("the same within 1e-3 (same global batch)." if same else f"differs by {abs(a.loss - b.loss):.4f}."))
        return TryResult(nums(a), nums(b), note, result.figure())
    return run


def _measure_example() -> Outcome:
    from troubleshooter.repro import oom

    result = oom()
    base = result.baseline
    return Outcome(f"{_EXAMPLE_RUN}: the step needs {base.needs_mb:.1f} MiB; under a {result.budget_mb:g} MiB "
                   f"limit: {result.outcome(base)}", None,
                   {"needs MiB (no limit)": base.needs_mb, "limit MiB": result.budget_mb,
                    "out of memory under the limit": base.oom},
                   ["Your error carries no sizes to read, so this measures the example instead."])


def _read_numbers(context: UserContext) -> Outcome:
    n = context.oom
    assert n is not None
    gib = lambda v: None if v is None else round(v / 2**30, 2)  # noqa: E731
    return Outcome(f"your error: {n.summary()}", not n.fragmentation,
                   {"requested GiB": gib(n.requested), "allocated GiB": gib(n.allocated),
                    "reserved GiB": gib(n.reserved), "reserved but unused GiB": gib(n.reserved_unallocated),
                    "fragmentation": n.fragmentation}, [])


def oom_walkthrough(config: Mapping | None = None, world_size: int = 1, num_gpus: int = 16,
                    context: UserContext | None = None) -> Walkthrough:
    """Out of memory; host RAM when the diagnosed entry is ``cpu-oom``, GPU otherwise.

    ``num_gpus`` sizes the memory planner's example (Mixtral-8x7B, 8 GPUs per node) in the ZeRO step.
    """
    if context is None:
        context = UserContext(config=config, config_label="config" if config is not None else "",
                              world_size=world_size)
    world_size = context.world_size or world_size
    config, label, example = context.config_or(OOM_CONFIG)
    micro = int(config.get("train_micro_batch_size_per_gpu", 16))
    acc = int(config.get("gradient_accumulation_steps", 1))
    half = {"train_micro_batch_size_per_gpu": max(1, micro // 2), "gradient_accumulation_steps": acc * 2}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = int(zero.get("stage", 0))
    stage_up = {"zero_optimization": {"stage": min(3, stage + 1)}}
    if stage + 1 >= 3:
        stage_up["zero_optimization"].update({k: v for k, v in knowledge.get("cuda-oom").patch_json()[
            "zero_optimization"].items() if k != "stage"})
    offload = {"zero_optimization": {"stage": max(stage, 2),
                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    host = context.entry_id == "cpu-oom"

    def plan_check() -> Outcome:
        from lightning_zeromoe.planner import MIXTRAL_8X7B, moe_transformer_counts, plan

        m = MIXTRAL_8X7B
        p = plan(counts=moe_transformer_counts(**m), num_gpus=num_gpus, gpus_per_node=8, gpu_memory_bytes=80e9,
                 ep_size=8, micro_batch=1, seq_len=4096, hidden_size=m["hidden_size"], num_layers=m["num_layers"],
                 num_heads=m["num_heads"], ffn_hidden_size=m["ffn_hidden_size"], top_k=2,
                 vocab_size=m["vocab_size"], activation_checkpointing=True)
        rec = p.recommend()
        return Outcome(f"memory planner, example Mixtral-8x7B, 4k tokens per GPU, {num_gpus} x 80 GB (ep_size 8): "
                       + (rec.setup.label if rec.setup else "nothing fits"), rec.fits, {},
                       [rec.reason, *p.table().splitlines()])

    micro_step = Step("Micro-batch down, gradient accumulation up", "cuda-oom", ("lower-micro-batch",),
                      "Lint the patched config", lambda: lint_check(merge_patch(config, half), world_size,
                                                                    f"{label}, patched"),
                      lambda: config_diff(config, half, label), _ladder_try(0, 1))
    ckpt_step = Step("Activation checkpointing", "cuda-oom", ("activation-checkpointing",),
                     "Measure with checkpointing (example)", _measure_checkpointing,
                     lambda: text_diff("for layer in model.layers:\n    x = layer(x)\n",
                                       "from torch.utils.checkpoint import checkpoint\n\nfor layer in model.layers:\n"
                                       "    x = checkpoint(layer, x, use_reentrant=False)\n", "model.py"),
                     _ladder_try(1, 2))
    if host:
        offloaded = [k for k in ("offload_param", "offload_optimizer") if zero.get(k)]
        offload_less = {"zero_optimization": {offloaded[0]: None}} if offloaded else {}

        def offload_diff() -> str:
            if not offloaded:
                return f"(nothing to change: {label} offloads nothing to host memory)"
            return config_diff(config, offload_less, label)
        steps = [
            Step("Confirm it is host RAM", "cpu-oom", ("confirm-with-dmesg",), "Check host memory",
                 lambda: doctor_check("host"),
                 lambda: text_diff("trainer.fit(module)\n", "import resource\n\ntrainer.fit(module)\n"
                                   "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, 'MiB peak RSS')\n"),
                 try_unavailable="This step reads this machine's memory; nothing to rerun."),
            Step("Build the model partitioned", "cpu-oom", ("build-partitioned",), "Lint the config",
                 lambda: lint_check(config, world_size, label),
                 lambda: text_diff("model = AutoModelForCausalLM.from_pretrained(name)\n",
                                   "import deepspeed\n\nwith deepspeed.zero.Init(config_dict_or_path=ds_config):\n"
                                   "    model = AutoModelForCausalLM.from_pretrained(name)\n"),
                 try_unavailable="Loading a pretrained model partitioned needs several ranks and the model's weights."),
            Step("Keep less on the host", "cpu-oom", ("reduce-offload",), "Lint the config",
                 lambda: lint_check(merge_patch(config, offload_less), world_size, f"{label}, patched"),
                 offload_diff,
                 try_unavailable="Offload needs a GPU to offload from."),
            micro_step, ckpt_step,
        ]
        title, entries = "Out of memory (host RAM)", ("cpu-oom", "cuda-oom", "offload-last-resort")
    else:
        numbers = context.oom
        if numbers is not None:
            first = Step("Read the numbers of your error", "cuda-oom",
                         ("measure-memory", "expandable-segments") if numbers.fragmentation else ("measure-memory",),
                         "Read the sizes in the message", lambda: _read_numbers(context),
                         lambda: text_diff("python train.py\n", "PYTORCH_ALLOC_CONF=expandable_segments:True "
                                           "python train.py\n", "launch.sh") if numbers.fragmentation else
                         text_diff("loss.backward()\noptimizer.step()\n",
                                   "torch.cuda.reset_peak_memory_stats()\nloss.backward()\noptimizer.step()\n"
                                   "print(f\"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\")\n"),
                         try_unavailable="Your GPU's numbers are read from the message; nothing to rerun here.")
        else:
            first = Step("Measure before changing anything", "cuda-oom", ("measure-memory",), "Measure the example step",
                         _measure_example,
                         lambda: text_diff("loss.backward()\noptimizer.step()\n",
                                           "torch.cuda.reset_peak_memory_stats()\nloss.backward()\noptimizer.step()\n"
                                           "print(f\"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\")\n"),
                         try_unavailable="This step measures; the next ones rerun the example with each fix.")
        steps = [
            first, micro_step, ckpt_step,
            Step("ZeRO stage up", "cuda-oom", ("raise-zero-stage",), "Ask the memory planner", plan_check,
                 lambda: config_diff(config, stage_up, label),
                 try_unavailable="ZeRO partitions over data-parallel ranks: a 1-process reproduction cannot show it. "
                                 "The planner's per-GPU numbers are the check."),
            Step("Offload, last", "offload-last-resort",
                 ("try-before-offload", "offload-optimizer-only", "check-pinned-memory"),
                 "Lint the offload config", lambda: lint_check(merge_patch(config, offload), world_size,
                                                               f"{label}, with offload"),
                 lambda: config_diff(config, offload, label),
                 try_unavailable="Offload moves GPU memory to the host; on a CPU-only machine there is nothing to move."),
        ]
        title, entries = "Out of memory (GPU)", ("cuda-oom", "cpu-oom", "offload-last-resort")
    note = (f"No DeepSpeed config was found in the failing cell or the notebook: the steps lint and patch an "
            f"example ({', '.join(f'{k}={v}' for k, v in OOM_CONFIG.items() if not isinstance(v, dict))}).") \
        if example else ""
    return Walkthrough("oom", title, entries, steps, context, example_note=note)


def _measure_checkpointing() -> Outcome:
    """What the halved micro-batch needs with and without activation checkpointing (example model)."""
    from troubleshooter.repro import oom

    result = oom()
    plain, ckpt = result.rungs[1], result.rungs[2]
    return Outcome(f"{_EXAMPLE_RUN}: checkpointing {plain.needs_mb:.1f} -> {ckpt.needs_mb:.1f} MiB peak", True,
                   {"needs MiB without": plain.needs_mb, "needs MiB with": ckpt.needs_mb,
                    "seconds without": plain.seconds, "seconds with": ckpt.seconds},
                   ["A second forward per layer in backward, in exchange for the activations."])
