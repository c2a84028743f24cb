"""Native ``deepspeed.moe.layer.MoE`` under ZeRO-3 (DeepSpeed refuses it), then the same model
under ZeRO-2 really training. Run by :func:`troubleshooter.repro.native_moe_zero3` in a child,
because it creates a process group and selects DeepSpeed's CPU accelerator; prints JSON lines.

A one-process gloo group is enough: the refusal happens in ``deepspeed.initialize``
(``runtime/engine.py::_validate_zero3_moe_compatibility``) before any communication.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def emit(**data) -> None:
    print(json.dumps(data, default=str), flush=True)


def main(spec: dict) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    import logging

    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    deepspeed.utils.logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    # LOCAL_SIZE == WORLD_SIZE: DeepSpeed's CPU all-reduce made a 69 MB /dev/shm buffer it never removes.
    from lightning_zeromoe.engine.processes import release_cpu_allreduce_buffer

    release_cpu_allreduce_buffer(0)

    class NativeMoENet(nn.Module):
        """Embedding -> native DeepSpeed MoE FFN -> head; forward returns (task loss, l_aux)."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(spec["seed"])
            h = spec["hidden"]
            self.embed = nn.Embedding(spec["vocab"], h)
            expert = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
            self.moe = MoE(hidden_size=h, expert=expert, num_experts=spec["experts"], ep_size=1, k=2,
                           min_capacity=4)
            self.head = nn.Linear(h, spec["vocab"])

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.embed(ids[:, :-1])
            y, l_aux, _ = self.moe(x)
            logits = self.head(x + y)
            task = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            return task, l_aux

    def config(stage: int) -> dict:
        return {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9}

    def engine_for(stage: int):
        model = NativeMoENet()
        # Native MoE under ZeRO 1/2 needs its expert parameters in groups marked 'moe' (entry moe-param-groups).
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"})
        optimizer = torch.optim.AdamW(groups, lr=spec["lr"])
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage))
        return engine

    # 1. ZeRO-3: DeepSpeed's own refusal.
    try:
        engine_for(3)
        emit(stage=3, refused=False)
    except Exception as err:  # noqa: BLE001 - the error is the result
        emit(stage=3, refused=True, error_type=type(err).__name__, error=str(err),
             traceback="".join(traceback.format_exception(type(err), err, err.__traceback__))[-3000:])

    # 2. The fix that keeps native MoE: ZeRO-2, with MoE parameter groups.
    engine = engine_for(2)
    gen = torch.Generator().manual_seed(spec["seed"])
    # A learnable stream: token t+1 = (3 * t + 1) mod vocab, from random starts.
    starts = torch.randint(0, spec["vocab"], (spec["steps"] * spec["batch"], 1), generator=gen)
    seqs = [starts]
    for _ in range(spec["seq"]):
        seqs.append((3 * seqs[-1] + 1) % spec["vocab"])
    data = torch.cat(seqs, dim=1)
    losses, auxes = [], []
    for step in range(spec["steps"]):
        ids = data[step * spec["batch"]:(step + 1) * spec["batch"]]
        task, l_aux = engine(ids)
        loss = task + spec["aux_weight"] * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(float(task))
        auxes.append(float(l_aux))
    emit(stage=2, trained=True, losses=losses, aux=auxes, zero_stage=engine.zero_optimization_stage(),
         deepspeed=deepspeed.__version__)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
