"""What the setup-time conversion probe costs on the ~344 M Mixtral of ``benchmarks/load_memory.py``.

One process, no process group: the model is built from the same config as ``load_memory.py``
(32 layers x 8 experts, hidden 512), optionally cast to bf16, and
:func:`lightning_zeromoe.conversion.check.check_conversion` is timed over all its MoE blocks, as
every rank runs it inside ``ZeroMoEStrategy`` before ``deepspeed.initialize``. Under ZeRO-3 each
rank also gathers each block once for the probe (the same before and after; not measured here).

    python benchmarks/probe_cost.py                       # fp32 and bf16, all 32 layers
    python benchmarks/probe_cost.py --dtypes bf16 --layers 8
    python benchmarks/probe_cost.py --impl /tmp/old_conversion_check.py   # time another version
    python benchmarks/probe_cost.py --expert-grads       # with the expert-weight gradients compared

``--impl`` loads a ``conversion_check`` module from a file (e.g. ``git show
<rev>:lightning_zeromoe/conversion/check.py > /tmp/old.py``), so a before/after comparison runs
on the same machine, back to back. Prints one line per dtype: wall seconds in total and per block,
the process's CPU seconds (steadier than wall time on a shared machine), and the largest errors
the probe measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def load_impl(path: str | None) -> ModuleType:
    """The ``conversion_check`` module to time: the repository's, or one read from ``path``."""
    if path is None:
        from lightning_zeromoe.conversion import check as conversion_check

        return conversion_check
    spec = importlib.util.spec_from_file_location("conversion_check_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def build(layers: int) -> Any:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from load_memory import MIXTRAL

    torch.manual_seed(0)
    config = MixtralConfig(**dict(MIXTRAL, num_hidden_layers=layers))
    config._attn_implementation = "eager"
    return MixtralForCausalLM(config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--impl", help="a conversion_check.py to time instead of the repository's")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--expert-grads", action="store_true",
                        help="also compare the expert weights' gradients (what the probe does where the "
                             "grouped-GEMM path is compared, i.e. bf16 on CUDA)")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import torch

    from lightning_zeromoe.discovery.find import discover

    impl = load_impl(args.impl)
    model = build(args.layers)
    numel = sum(p.numel() for p in model.parameters())
    print(f"Mixtral: {numel / 1e6:.0f} M parameters, {args.layers} MoE blocks; "
          f"torch threads {torch.get_num_threads()}; "
          f"implementation {args.impl or 'lightning_zeromoe.conversion.check'}", flush=True)
    for name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        model = model.to(dtype)
        found = discover(model)
        times, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            _, checks = impl.check_conversion(model, found, **({"expert_grads": True} if args.expert_grads else {}))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        passed = sum(c.passed for c in checks)
        seconds = statistics.median(times)
        worst = max((c.output_error or 0.0) for c in checks)
        extra = ""
        reports = [c.report for c in checks if getattr(c, "report", None) is not None]
        if reports:  # the probe of issue 16: every quantity it compared, the tokens, the training-dtype gap
            keys = list(reports[0].errors)
            extra = (f"; worst {', '.join(f'{k} {max(r.errors[k] for r in reports):.2g}' for k in keys)}; "
                     f"tokens {reports[0].tokens}, experts hit {min(r.experts_hit for r in reports)}/"
                     f"{reports[0].num_experts}")
            if reports[0].dtype_gap:  # both blocks in bf16 against the fp32 reference (routing flips show here)
                extra += (f"; {name} output gap: original {max(r.dtype_gap['output'][0] for r in reports):.2g}, "
                          f"AutoEP layer {max(r.dtype_gap['output'][1] for r in reports):.2g}")
        per_block = seconds / max(1, len(checks)) * 1000
        print(f"{name}: {seconds:.2f} s wall for {len(checks)} blocks ({per_block:.0f} ms/block; "
              f"runs {', '.join(f'{t:.2f}' for t in times)}; CPU time {statistics.median(cpu):.2f} s), "
              f"{passed} passed, "
              f"worst output error {worst:.2g}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
