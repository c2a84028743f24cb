"""ZeRO-3 pitfalls: tied weights, device moves in forward, stale parameter copies.

The checks read the model's own ``forward`` sources (the user's model when one is passed, the
example tiny MoE otherwise); "Try it" runs the 2-rank reproduction (:mod:`troubleshooter.repro.pitfalls`).
"""

from __future__ import annotations

from typing import Any, Callable

from troubleshooter.walkthroughs.base import Outcome, Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.checks import scan_forward_sources
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import text_diff

__all__ = ["pitfalls_walkthrough"]


def _pit_try(name: str) -> Callable[[], TryResult]:
    def run() -> TryResult:
        import troubleshooter.repro as repro

        r = getattr(repro, name)()
        return TryResult(r.before, r.after, r.summary_line)
    return run


def pitfalls_walkthrough(model: Any = None, context: UserContext | None = None) -> Walkthrough:
    def tied_check() -> Outcome:
        if model is not None:
            return scan_forward_sources(model)
        from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

        outcome = scan_forward_sources(TinyMoELM(TinyMoEConfig(tie_embeddings=True)))
        outcome.headline = outcome.headline.replace("the example tiny MoE", "the example tiny MoE (tied head)")
        return outcome

    steps = [
        Step("Tied or shared weights", "zero3-param-not-available",
             ("register-external-parameter", "gather-parameters"), "Find tied parameters", tied_check,
             lambda: text_diff("strategy = ZeroMoEStrategy(ep_size=2)\n",
                               "strategy = ZeroMoEStrategy(\n    ep_size=2, shared_parameters={\"head\": "
                               "[\"embed.weight\"]})\n"),
             _pit_try("tied_weights")),
        Step("Device and dtype moves in forward", "device-mismatch",
             ("create-on-existing-device", "register-submodules"), "Scan forward for moves",
             lambda: scan_forward_sources(model),
             lambda: text_diff("    def forward(self, x):\n        self.proj.to(\"cuda\")\n"
                               "        mask = torch.ones(x.shape[1]).cuda()\n",
                               "    def forward(self, x):\n        mask = torch.ones(x.shape[1], device=x.device)\n",
                               "model.py"),
             _pit_try("device_move")),
        Step("Stale parameter copies (cached .data)", "zero3-param-not-available",
             ("gather-parameters", "call-through-engine"), "Scan forward for .data",
             lambda: scan_forward_sources(model),
             lambda: text_diff("    def forward(self, x):\n        if self._w is None:\n"
                               "            self._w = self.proj.weight.data\n        return x @ self._w.t()\n",
                               "    def forward(self, x):\n        return self.proj(x)\n", "model.py"),
             _pit_try("stale_param_copy")),
    ]
    return Walkthrough("zero3-pitfalls", "Tied weights, device moves, stale parameter copies (ZeRO-3)",
                       ("zero3-param-not-available", "device-mismatch"), steps, context)
