"""``native_moe_zero3()``: DeepSpeed's real refusal of native MoE under ZeRO-3, then the fix running.

The child (``_native_moe_child``) builds a model with ``deepspeed.moe.layer.MoE``, calls
``deepspeed.initialize`` with ZeRO stage 3 on a one-process gloo group and records the
``AssertionError`` DeepSpeed 0.19.8 raises (``runtime/engine.py::_validate_zero3_moe_compatibility``).
Then it applies the fix that keeps the native layer, ZeRO stage 2 with the MoE parameter groups
DeepSpeed requires (knowledge entries ``native-moe-zero3`` and ``moe-param-groups``), and trains a
few steps so the losses prove it runs. The other fix, ZeRO-3 with AutoEP, is what
``ZeroMoEStrategy`` does; ``notebooks/04_train_with_zeromoe.ipynb`` runs it on 2 CPU processes.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

from troubleshooter.repro._common import html_table, new_figure, run_child


def free_port() -> int:
    """A TCP port nobody listens on now (for the child's one-process rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NativeMoEResult:
    """The stage-3 error as DeepSpeed raised it, and the stage-2 run that replaced it."""

    refused: bool
    error_type: str
    error_message: str
    error_traceback: str
    fix_stage: int
    fix_losses: list[float] = field(default_factory=list)
    fix_aux: list[float] = field(default_factory=list)
    deepspeed_version: str = ""

    @property
    def fix_description(self) -> str:
        return (f"ZeRO stage {self.fix_stage} keeps deepspeed.moe.layer.MoE, with its parameters in MoE groups "
                "(split_params_into_different_moe_groups_for_optimizer); ZeRO-3 needs AutoEP instead.")

    @property
    def trained(self) -> bool:
        """The fixed run took every step and its loss went down."""
        return bool(self.fix_losses) and self.fix_losses[-1] < self.fix_losses[0]

    def diagnosis(self) -> list:
        """What the knowledge base says about the recorded error (the explain pipeline, for real)."""
        from troubleshooter.explain import explain_text

        return explain_text(self.error_traceback)

    def summary(self) -> str:
        loss = f"{self.fix_losses[0]:.3f} -> {self.fix_losses[-1]:.3f}" if self.fix_losses else "-"
        return (f"ZeRO-3 + native MoE (deepspeed {self.deepspeed_version}): "
                f"{self.error_type}: {self.error_message}\n"
                f"fix: ZeRO stage {self.fix_stage}: {len(self.fix_losses)} steps, task loss {loss}")

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        rows = [["ZeRO-3", f"{self.error_type}: {self.error_message}"],
                [f"ZeRO-{self.fix_stage} (fix)", f"trained {len(self.fix_losses)} steps, loss "
                 + (f"{self.fix_losses[0]:.3f} -> {self.fix_losses[-1]:.3f}" if self.fix_losses else "-")]]
        return "<b>Native DeepSpeed MoE under ZeRO-3</b>" + html_table(["run", "outcome"], rows)

    def figure(self):
        fig = new_figure(5, 3)
        ax = fig.add_subplot()
        ax.plot(self.fix_losses, marker="o", label="task loss")
        ax.plot(self.fix_aux, marker=".", label="l_aux")
        ax.set_xlabel("step")
        ax.set_title(f"native MoE under ZeRO-{self.fix_stage} (ZeRO-3 refused)")
        ax.legend()
        return fig


_RESULTS: dict[tuple[int, int], NativeMoEResult] = {}


def native_moe_zero3(*, steps: int = 8, seed: int = 0, timeout: float = 300) -> NativeMoEResult:
    """Run the reproduction in a child process and return what happened (kept per setting for the
    life of the process: it is deterministic, and a walkthrough's "try it" then costs nothing)."""
    if (steps, seed) in _RESULTS:
        return _RESULTS[(steps, seed)]
    spec = {"port": free_port(), "seed": seed, "hidden": 32, "vocab": 64, "experts": 4, "batch": 8, "seq": 16,
            "steps": steps, "lr": 0.01, "aux_weight": 0.01}
    records, stderr = run_child(["-m", "troubleshooter.repro._native_moe_child", json.dumps(spec)], timeout=timeout)
    by_stage = {r["stage"]: r for r in records}
    if 3 not in by_stage or 2 not in by_stage:
        raise RuntimeError(f"the native-MoE reproduction printed no result:\n{stderr[-3000:]}")
    s3, s2 = by_stage[3], by_stage[2]
    result = NativeMoEResult(refused=s3["refused"], error_type=s3.get("error_type", ""),
                             error_message=s3.get("error", ""), error_traceback=s3.get("traceback", ""),
                             fix_stage=s2["zero_stage"], fix_losses=s2["losses"], fix_aux=s2["aux"],
                             deepspeed_version=s2.get("deepspeed", ""))
    _RESULTS[(steps, seed)] = result
    return result
