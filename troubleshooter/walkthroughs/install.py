"""Install or CUDA mismatch: versions, CUDA toolkit vs torch, compiler/ninja, stale JIT locks.

Every check is the doctor's own, on this machine; "Try it" reruns it after the user applied a fix.
"""

from __future__ import annotations

from typing import Callable

from troubleshooter.walkthroughs.base import Outcome, Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.checks import doctor_check
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import text_diff

__all__ = ["install_walkthrough"]


def _recheck(*families: str) -> Callable[[], TryResult]:
    first: dict[str, Outcome] = {}

    def run() -> TryResult:
        before = first.setdefault("before", doctor_check(*families))
        now = doctor_check(*families)
        first["before"] = now
        return TryResult(before.numbers, now.numbers, "The doctor's checks before and after the change.")
    return run


def install_walkthrough(context: UserContext | None = None) -> Walkthrough:
    steps = [
        Step("Versions and known-bad combinations", "autoep-transformers-5.23", ("pin-transformers",),
             "Check versions", lambda: doctor_check("versions"),
             lambda: text_diff("deepspeed==0.19.8\ntransformers\n", "deepspeed==0.19.8\ntransformers>=5.17,<5.23\n",
                               "requirements.txt"), _recheck("versions")),
        Step("torch's CUDA vs the system CUDA", "cuda-version-mismatch", ("compare-cuda-versions", "install-matching-torch"),
             "Check CUDA", lambda: doctor_check("cuda"),
             lambda: text_diff("pip install torch\n",
                               "pip install torch --index-url https://download.pytorch.org/whl/cu124\n", "setup.sh"),
             _recheck("cuda")),
        Step("Compiler, ninja and CUDA_HOME for JIT-built ops", "missing-compiler", ("install-toolchain",),
             "Check the build tools", lambda: doctor_check("build"),
             lambda: text_diff("pip install deepspeed\n", "apt-get install -y build-essential ninja-build\n"
                               "pip install deepspeed\n", "setup.sh"), _recheck("build")),
        Step("Stale JIT build locks", "stale-extension-lock", ("delete-stale-lock", "delete-half-built-op"),
             "Look for stale locks", lambda: doctor_check("env"),
             lambda: text_diff("python train.py\n", "find ${TORCH_EXTENSIONS_DIR:-~/.cache/torch_extensions} "
                               "-name lock -delete\npython train.py\n", "launch.sh"), _recheck("env")),
    ]
    return Walkthrough("install", "CUDA mismatch or install problem",
                       ("cuda-version-mismatch", "cuda-home-missing", "missing-compiler", "stale-extension-lock"),
                       steps, context)
