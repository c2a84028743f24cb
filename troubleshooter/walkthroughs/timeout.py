"""Collective timeout: find the first failure; raise the timeout where it is read; same order."""

from __future__ import annotations

from typing import Any

from troubleshooter.walkthroughs.base import Outcome, Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.checks import doctor_check
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import text_diff

__all__ = ["timeout_walkthrough"]


def timeout_walkthrough(log: str | None = None, context: UserContext | None = None) -> Walkthrough:
    """``log``: the text to search for the first failure (default: the error of the context)."""
    context = context or UserContext()
    log = log if log is not None else (context.error_text or None)

    def first_failure() -> Outcome:
        if log is None:
            return doctor_check("timeouts")
        from troubleshooter.explain import explain_text

        found = explain_text(log)
        return Outcome(f"{len(found)} known problem(s) in the log; the first cause: "
                       f"{found[0].title if found else 'none'}", not found, {},
                       [f"{d.entry_id} (line {d.line_no}): {d.snippet}" for d in found])

    def try_group_timeouts() -> TryResult:
        from troubleshooter.repro import collective_timeout

        result = collective_timeout()

        def nums(run: Any) -> dict:
            return {"world group timeout (s)": run.world_timeout, "expert group timeout (s)": run.expert_group_timeout,
                    "rank 0 waited (s)": run.waited, "timed out": run.timed_out}

        return TryResult(nums(result.before), nums(result.after),
                         f"2 gloo ranks; rank 1 stays away for {result.stuck_for:g} s while rank 0 all-reduces on a "
                         "group made with new_group(ranks), as DeepSpeed makes its expert groups. The fix is "
                         "what ZeroMoEStrategy runs after deepspeed.initialize.")

    steps = [
        Step("Find the first failure", "nccl-watchdog-timeout", ("find-first-failure",), "Read the log / check timeouts",
             first_failure,
             lambda: text_diff("export NCCL_TIMEOUT=3600\n", "# NCCL_TIMEOUT is read by nothing\n"
                               "grep -n -m1 -E 'Traceback|Error|out of memory' logs/rank*.log\n", "launch.sh"),
             try_unavailable="No reproduction: a timeout is the echo of another failure."),
        Step("Raise the timeout where it is read", "nccl-watchdog-timeout", ("raise-timeout-where-read",),
             "Check timeout settings", lambda: doctor_check("timeouts"),
             lambda: text_diff("strategy = ZeroMoEStrategy(ep_size=8)\n",
                               "from datetime import timedelta\n\n"
                               "strategy = ZeroMoEStrategy(ep_size=8, timeout=timedelta(minutes=60))\n"),
             try_group_timeouts),
        Step("Same collectives, same order, on every rank", "nccl-watchdog-timeout",
             ("same-collective-order", "nccl-debug"), "Check NCCL settings",
             lambda: doctor_check("nccl"),
             lambda: text_diff("if trainer.global_rank == 0:\n    trainer.save_checkpoint(path)\n",
                               "trainer.save_checkpoint(path)  # collective under ZeRO-3: every rank calls it\n"),
             try_unavailable="A collective issued by some ranks only hangs the others until the timeout; "
                             "the previous step's reproduction shows that wait."),
    ]
    return Walkthrough("timeout", "Collective timeout", ("nccl-watchdog-timeout", "subgroup-timeout"), steps, context)
