"""Measure the model-state bytes each rank really holds, for the planner's measured check.

Launched once per world size (``torchrun --nproc_per_node N``, or plain ``python`` for N = 1,
which then starts torchrun itself). In one process group it builds a fresh tiny MoE model and a
raw DeepSpeed engine for every requested (stage, ep_size) pair, runs one fp32 training step, and
records ``lightning_zeromoe.observe.telemetry.state_bytes(engine)`` twice: right after ``backward`` (when
the gradient partitions are what stages 1 and 2 hold) and after ``step`` (when the Adam states
exist; Adam creates them lazily at the first step). Raw DeepSpeed rather than Lightning: each
Lightning launch would re-import Lightning in every rank, and 4 ranks share 2 cores.

    python tests/jobs/planner_states.py --out DIR --world 4 --configs 3:1,3:2,2:1,1:2
    python tests/jobs/planner_states.py --out DIR --world 2 --configs 3:1,3:2 --precision bf16-true

``--precision`` is Lightning's spelling of what the engine gets: ``32-true`` (fp32 model, no
``bf16`` section), ``bf16-mixed`` (fp32 model handed to an engine with ``bf16.enabled``, which
casts it) or ``bf16-true`` (the model built in bf16, as Lightning's ``bf16-true`` init context
does, and ``bf16.enabled``). Each run also records the process's peak resident memory during
``engine.step()`` over the memory just before it (``/proc/self/status`` VmHWM, reset through
``/proc/self/clear_refs``): the transient cost of the optimizer step. ``--scale`` multiplies the
model's hidden and expert sizes so that this transient stands out from the allocator's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: The model every run measures. Small enough for 4 ranks on 2 cores; every dimension divisible
#: by 4 so the planner's per-tensor rounding is exercised but not dominant.
MODEL = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_experts=4, top_k=2,
             ffn_hidden_size=96, max_seq_len=16)


def engine_config(stage: int, ep_size: int, model, precision: str = "32-true") -> dict:
    from lightning_zeromoe.config.deepspeed import ZeroOptions, build_config

    # param_persistence_threshold=0: ZeRO-3 partitions every parameter (no small-tensor exception).
    opts = ZeroOptions(stage=stage, ep_size=ep_size, param_persistence_threshold=0)
    from lightning_zeromoe.discovery.find import discover

    # The same block description the strategy would hand AutoEP (rooted at the model itself).
    locate = discover(model, None).autoep if ep_size > 1 else None
    config = build_config(opts, locate, use_grouped_mm=False)
    config.update({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0,
                                                              "torch_adam": True}}})
    if precision.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    return config


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def model_dims(scale: int) -> dict:
    return dict(MODEL, hidden_size=MODEL["hidden_size"] * scale, ffn_hidden_size=MODEL["ffn_hidden_size"] * scale)


def measure(stage: int, ep_size: int, precision: str = "32-true", scale: int = 1) -> dict:
    import argparse as ap

    import deepspeed
    import torch
    import torch.nn.functional as F

    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM, load_balancing_loss
    from lightning_zeromoe.observe.telemetry import state_bytes

    torch.manual_seed(0)
    dims = model_dims(scale)
    model = TinyMoELM(TinyMoEConfig(**dims))
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    engine, *_ = deepspeed.initialize(args=ap.Namespace(device_rank=int(os.environ.get("LOCAL_RANK", 0))),
                                      model=model, model_parameters=[p for p in model.parameters()],
                                      config=engine_config(stage, ep_size, model, precision), dist_init_required=False)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    ids = torch.randint(0, MODEL["vocab_size"], (2, 9), generator=gen)
    logits, router = engine(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss = loss + 0.01 * load_balancing_loss(router, MODEL["top_k"], 2).mean()
    engine.backward(loss)
    after_backward = state_bytes(engine)
    import gc

    gc.collect()
    before_step = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    engine.step()
    step_peak = (_status_kib("VmHWM") - before_step) * 1024
    after_step = state_bytes(engine)
    result = {"stage": stage, "ep_size": ep_size, "precision": precision, "scale": scale,
              "after_backward": after_backward.__dict__, "after_step": after_step.__dict__,
              "step_peak_bytes": step_peak,
              "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
              "held": {n: getattr(p, "ds_tensor", p).numel() for n, p in engine.module.named_parameters()}}
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--configs", default="3:1", help="comma-separated stage:ep_size pairs")
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "bf16-true"))
    parser.add_argument("--scale", type=int, default=1)
    args = parser.parse_args()

    if "LOCAL_RANK" not in os.environ:  # not under torchrun yet: become the launcher
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
               __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))

    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = []
    for pair in args.configs.split(","):
        stage, ep = (int(x) for x in pair.split(":"))
        results.append(measure(stage, ep, args.precision, args.scale))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": args.world, "runs": results}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
