"""The demo: train the tiny MoE with ZeRO-3 + expert parallelism, then show what happened.

    zeromoe-demo                      # 2 CPU processes, or the GPUs it finds
    python -m lightning_zeromoe.demo  # the same
    zeromoe-demo --steps 50 --ep-size 2 --devices 2 --accelerator cpu

It prints a progress bar with the loss, then tokens/s, each expert's share of the routed tokens
per layer, and the bytes of parameters, gradients and optimizer states each rank holds; and it
saves a DeepSpeed checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# torch.distributed's own deprecation notices fire on every collective DeepSpeed makes.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
from lightning_zeromoe import invocation  # noqa: E402
from lightning_zeromoe.engine import collectives  # noqa: E402
from lightning_zeromoe.engine.notices import silence_known_notices  # noqa: E402
from lightning_zeromoe.knowledge import say  # noqa: E402

silence_known_notices()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Every option of ``zeromoe-demo``; ``prog`` defaults to the name it was started by."""
    parser = argparse.ArgumentParser(prog=prog or invocation.prog("zeromoe-demo"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--ep-size", type=int, default=2, help="expert-parallel group size (default 2)")
    parser.add_argument("--devices", type=int, default=2, help="processes / GPUs (default 2)")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: the GPUs if CUDA is available, else CPU processes (default)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--precision", default=None, help="default: bf16-true on GPU, 32-true on CPU")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the checkpoint goes")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("steps", "ep_size", "devices", "batch_size", "num_experts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def resolve_accelerator(requested: str, devices: int) -> tuple[str, int, str]:
    """(accelerator, devices, why): use GPUs only when asked for or when they exist."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "gpu" and gpus == 0:
        raise SystemExit(say("demo-accelerator", "no-gpu", "cpu-or-doctor"))
    if requested == "gpu" or (requested == "auto" and gpus > 0):
        if devices > gpus:
            raise SystemExit(say("demo-accelerator", "too-few-gpus", "fewer-devices", devices=devices, gpus=gpus))
        return "gpu", devices, f"{devices} of {gpus} GPU(s)"
    return "cpu", devices, f"{devices} CPU processes (gloo)"


def make_report_callback() -> Any:
    import lightning as L

    from lightning_zeromoe.observe.telemetry import global_counts, human_bytes, state_bytes, expert_shares

    class DemoReport(L.Callback):
        """Times steady-state throughput and prints expert shares and per-rank memory at the end."""

        def __init__(self) -> None:
            self.tokens = 0
            self.start: float | None = None
            self.report = ""  # filled on rank 0; printed after the progress bar has closed

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.start is None:  # the first step pays for warm-up; time from its end
                self.start = time.perf_counter()
                return
            self.tokens += batch["input_ids"][:, :-1].numel() * trainer.world_size

        def on_train_end(self, trainer: Any, module: Any) -> None:
            elapsed = time.perf_counter() - (self.start or time.perf_counter())
            counts = global_counts(module)
            ledger = state_bytes(trainer.strategy.deepspeed_engine)
            ledgers = _gather(ledger)
            if not trainer.is_global_zero:
                return
            lines = [f"\nloss {module.last_losses['loss']:.4f} (task {module.last_losses['task_loss']:.4f}, "
                     f"aux {module.last_losses['aux_loss']:.4f})",
                     f"throughput: {self.tokens / elapsed:,.0f} tokens/s over {trainer.global_step - 1} steps"
                     if elapsed > 0 else "throughput: n/a (one step)",
                     "expert share of routed tokens (all ranks):"]
            for layer, c in counts.items():
                shares = "  ".join(f"e{i}:{s:5.1%}" for i, s in enumerate(expert_shares(c)))
                lines.append(f"  {layer:<28} {shares}")
            lines.append("model state per rank (params | fp32 master | grads | optimizer states):")
            for rank, b in enumerate(ledgers):
                lines.append(f"  rank {rank}: {human_bytes(b.params):>10} | {human_bytes(b.master_params):>10} | "
                             f"{human_bytes(b.grads):>10} | {human_bytes(b.optimizer_states):>10}")
            self.report = "\n".join(lines)

    return DemoReport()


def _gather(obj: Any) -> list[Any]:
    return collectives.all_gather_object(obj)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; a setting the strategy refuses is one ``[entry-id]`` line on stderr and exit 2."""
    from lightning_zeromoe.config.validation import ZeroMoEConfigError

    args = parse_args(argv)
    try:
        return _run(args)
    except ZeroMoEConfigError as err:  # a bad flag, like argparse's own errors: no traceback
        print(f"{invocation.prog('zeromoe-demo')}: error: {err}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    accelerator, devices, where = resolve_accelerator(args.accelerator, args.devices)
    precision = args.precision or ("bf16-true" if accelerator == "gpu" else "32-true")

    import lightning as L

    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
    from lightning_zeromoe.strategy import ZeroMoEStrategy

    L.seed_everything(0, verbose=False)
    module = TinyMoEModule(TinyMoEConfig(num_experts=args.num_experts), batch_size=args.batch_size,
                           num_samples=args.batch_size * devices * args.steps)
    report = make_report_callback()
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, precision=precision, max_steps=args.steps, max_epochs=1,
        strategy=ZeroMoEStrategy(ep_size=args.ep_size, param_persistence_threshold=0),
        callbacks=[report], logger=False, enable_checkpointing=False,
        enable_model_summary=False, log_every_n_steps=1)
    if trainer.is_global_zero:
        print(f"ZeRO-3 + expert parallelism (ep_size={args.ep_size}) on {where}, precision {precision}", flush=True)
    trainer.fit(module)
    if trainer.is_global_zero:
        print(report.report, flush=True)
    ckpt = args.out / "checkpoint"
    trainer.save_checkpoint(ckpt, weights_only=False)
    if trainer.is_global_zero:
        print(f"checkpoint saved to {ckpt} (DeepSpeed ZeRO-3 shards, one file per rank)\n"
              f"export it as one model with its own parameter names: zeromoe-export {ckpt} {args.out / 'exported'}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
