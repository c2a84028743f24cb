"""The checks only a GPU can answer, as one script (under 8 minutes on one GPU), one JSON summary.

    python benchmarks/gpu_check.py [--json OUT.json] [--repeats 5]

One GPU cannot hold two NCCL ranks, so expert parallelism is exercised through AutoEP's layer at
``ep_size=1`` (its router and its grouped-GEMM expert path; no all-to-all). Parts:

1. ``strategy``: the strategy itself, as a user runs it, in a fresh process:
   ``Trainer(accelerator="gpu", devices=1, precision="bf16-true",
   strategy=ZeroMoEStrategy(ep_size=1, grouped_experts=True))`` over NCCL trains a tiny HF Mixtral
   with ``ExpertUtilizationMonitor``: the conversion probe and AutoEP's conversion run at setup, then
   bf16 training with grouped GEMM, ``trainer.save_checkpoint``, ``zeromoe-export`` (loaded back with
   ``from_pretrained``), a same-shape resume for more steps, and ``trainer.validate``. Checks: the
   MoE blocks became AutoEP layers with grouped GEMM, parameters are bf16, losses are finite and
   fall, the export loads without missing keys and gives the evaluation engine's logits, the resumed
   run continues from the saved step, validation returns a finite loss.
2. ``oom_explain``: a real ``torch.cuda.OutOfMemoryError`` (allocating more than the device has),
   its traceback fed to ``python -m troubleshooter explain --json``. Check: it matches the CUDA
   OOM entry.
3. ``doctor``: ``python -m troubleshooter doctor --json`` on this machine. Check: it runs, and
   reports its CUDA checks.
4. ``layer_throughput``: tokens/s of forward+backward of one MoE block, AutoEP's layer against HF's
   eager Mixtral block with the same weights, side by side, ``--repeats`` times; the median ratio.

On a machine without CUDA (the CPU fallback), part 1 runs on the CPU over gloo (bf16, without
grouped GEMM: torch's grouped GEMM is CUDA-only) and part 4 in fp32, and both say so; part 2 is
skipped (no CUDA OOM to provoke), part 3 runs and its CUDA checks report no GPU. Each part prints
one line ``[part] status: ...`` (``ok``, ``FAILED`` or ``skipped``) and the script exits 1 if any
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def tiny_mixtral(layers: int = 2, hidden: int = 64, experts: int = 4) -> Any:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=experts,
        num_experts_per_tok=2, tie_word_embeddings=False, attn_implementation="eager"))


def ds_config(bf16: bool, grouped_mm: bool) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
            "expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "mixtral",
                                "use_grouped_mm": grouped_mm}}


def init_single_process(cuda: bool) -> None:
    import deepspeed
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


STRATEGY_STEPS, RESUMED_STEPS = 20, 5


def strategy_end_to_end(cuda: bool) -> dict[str, Any]:
    """Part 1, in a fresh process (Lightning sets up its own process group and device)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        out = Path(tmp) / "strategy.json"
        proc = subprocess.run([sys.executable, __file__, "--strategy-part", str(out)], capture_output=True,
                              text=True, timeout=420, cwd=REPO)
        if not out.is_file():
            return {"ok": False, "error": f"the strategy part exited {proc.returncode} without a result",
                    "trace": (proc.stdout + proc.stderr)[-3000:]}
        result = json.loads(out.read_text())
    result["log_tail"] = [line for line in (proc.stdout + proc.stderr).splitlines() if "ZeroMoEStrategy" in line][-8:]
    return result


def _strategy_part(out: Path) -> None:
    """What :func:`strategy_end_to_end` runs: train, save, export, resume, validate."""
    import lightning as L
    import torch
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from lightning_zeromoe import ExpertUtilizationMonitor, ZeroMoEStrategy
    from lightning_zeromoe.checkpoint import export
    from lightning_zeromoe.reference.models import SyntheticLMData

    cuda = torch.cuda.is_available()
    held_out = SyntheticLMData(num_samples=2, seq_len=17, vocab_size=128, seed=7).tokens

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_mixtral()
            self.losses: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids = batch["input_ids"]
            loss = self.net(input_ids=ids, labels=ids, use_cache=False).loss
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            ids = batch["input_ids"]
            self.log("val_loss", self.net(input_ids=ids, labels=ids, use_cache=False).loss)
            self.eval_logits = self.net(input_ids=held_out.to(ids.device), use_cache=False).logits.float().cpu()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(SyntheticLMData(num_samples=160, seq_len=17, vocab_size=128, seed=0), batch_size=4)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(SyntheticLMData(num_samples=8, seq_len=17, vocab_size=128, seed=3), batch_size=4)

    def trainer(max_steps: int) -> L.Trainer:
        return L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-true", max_steps=max_steps,
                         strategy=ZeroMoEStrategy(ep_size=1, grouped_experts=True), logger=False,
                         callbacks=[ExpertUtilizationMonitor(every_n_steps=5)], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=2, val_check_interval=None, check_val_every_n_epoch=1000)

    t0 = time.perf_counter()
    module = Module()
    first = trainer(STRATEGY_STEPS)
    first.fit(module)
    engine = first.strategy.deepspeed_engine
    layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    grouped = sorted({bool(getattr(m, "use_grouped_mm", False)) for m in layers})
    dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
    ckpt = Path(out).with_name("ckpt")
    first.save_checkpoint(ckpt)
    first.validate(module, verbose=False)
    val_loss = float(first.callback_metrics.get("val_loss", float("nan")))
    exported = export(ckpt, Path(out).with_name("hf"), progress=False)
    loaded, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    with torch.no_grad():
        logits = loaded.to(torch.float32)(input_ids=held_out, use_cache=False).logits
    gap = float((logits - module.eval_logits).abs().max() / module.eval_logits.abs().max())
    resumed = Module()
    second = trainer(STRATEGY_STEPS + RESUMED_STEPS)
    second.fit(resumed, ckpt_path=ckpt)
    losses = module.losses
    checks = {
        "autoep_layers": len(layers) == 2, "grouped_gemm": grouped == [cuda], "bf16": dtypes == ["torch.bfloat16"],
        "losses_fall": all(x == x for x in losses) and losses[-1] < losses[0],
        "export_loads": not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")),
        # the export is bf16 (the trained dtype); the engine computed in bf16 too
        "export_logits": gap < 2e-2,
        "resumed": second.global_step == STRATEGY_STEPS + RESUMED_STEPS and len(resumed.losses) == RESUMED_STEPS,
        "validate": val_loss == val_loss,
    }
    result = {"ok": all(checks.values()), "checks": checks, "device": str(engine.device),
              "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
              "first_loss": losses[0], "last_loss": losses[-1], "resumed_losses": resumed.losses,
              "val_loss": val_loss, "export_logit_gap": gap, "param_dtypes": dtypes, "grouped_mm": grouped,
              "seconds": round(time.perf_counter() - t0, 1),
              "note": "" if cuda else "CPU fallback: gloo, bf16 without grouped GEMM (CUDA-only)"}
    Path(out).write_text(json.dumps(result, indent=1, default=str))


def oom_explain(cuda: bool) -> dict[str, Any]:
    if not cuda:
        return {"skipped": "no CUDA device: a CUDA out-of-memory error cannot be provoked here"}
    import torch

    free, total = torch.cuda.mem_get_info()
    try:
        torch.empty(int(total * 2), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        text = traceback.format_exc()
    else:
        return {"ok": False, "error": "allocating twice the device memory did not raise"}
    torch.cuda.empty_cache()
    proc = subprocess.run([sys.executable, "-m", "troubleshooter", "explain", "--json", "-"], input=text,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    try:
        found = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"ok": False, "error": f"explain printed no JSON (exit {proc.returncode}): {proc.stderr[-500:]}"}
    ids = [m.get("id") for m in (found.get("matches", []) if isinstance(found, dict) else found)]
    return {"ok": any("oom" in str(i) for i in ids), "matched": ids, "error_line": text.strip().splitlines()[-1][:200]}


def doctor(cuda: bool) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "troubleshooter", "doctor", "--json"], capture_output=True,
                          text=True, timeout=240, cwd=REPO)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"ok": False, "error": f"doctor printed no JSON (exit {proc.returncode}): {proc.stderr[-500:]}"}
    checks = report.get("results", report.get("checks", [])) if isinstance(report, dict) else report
    summary = [(c.get("id") or c.get("name"), c.get("status")) for c in checks] if isinstance(checks, list) else []
    cuda_checks = [c for c in summary if "cuda" in str(c[0]).lower() or "gpu" in str(c[0]).lower()]
    return {"ok": proc.returncode in (0, 1) and bool(summary), "exit": proc.returncode, "checks": summary,
            "cuda_checks": cuda_checks,
            "note": "" if cuda else "no CUDA device: the doctor's GPU checks only report that there is none"}


def layer_throughput(cuda: bool, repeats: int) -> dict[str, Any]:
    """AutoEP's MoE layer (inside a ZeRO-3 engine at autoep_size=1) vs HF's eager block, same weights."""
    import argparse as ap
    import copy

    import deepspeed
    import torch

    init_single_process(cuda)

    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, tokens = (1024, 8192) if cuda else (256, 1024)
    model = tiny_mixtral(layers=1, hidden=hidden, experts=8)
    hf_block = copy.deepcopy(model.model.layers[0].mlp)
    hf_block.experts.config._experts_implementation = "eager"
    device = torch.device("cuda" if cuda else "cpu")
    hf_block = hf_block.to(device=device, dtype=dtype)
    config = ds_config(bf16=cuda, grouped_mm=cuda)
    config["zero_optimization"] = {"stage": 0}  # the layer alone: no gathers in the timing
    from lightning_zeromoe._private.deepspeed import autoep_output_capture_shim

    with autoep_output_capture_shim():  # raw AutoEP on an HF model: transformers >= 5.23 needs it
        engine, *_ = deepspeed.initialize(args=ap.Namespace(device_rank=0), model=model,
                                          model_parameters=list(model.parameters()), config=config)
    ep_layer = engine.module.model.layers[0].mlp
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)

    def run(layer: torch.nn.Module) -> Callable[[], None]:
        def once() -> None:
            inp = x.detach().requires_grad_(True)
            out = layer(inp)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
        return once

    def timed(fn: Callable[[], None], iters: int = 5) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return tokens * iters / (time.perf_counter() - t0)

    pairs = [(timed(run(ep_layer)), timed(run(hf_block))) for _ in range(repeats)]
    ratios = [a / b for a, b in pairs]
    engine.destroy()
    return {"ok": True, "device": str(device), "dtype": str(dtype), "tokens": tokens, "hidden": hidden,
            "autoep_tokens_per_s": [round(a) for a, _ in pairs], "hf_eager_tokens_per_s": [round(b) for _, b in pairs],
            "ratio_median": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
            "note": "" if cuda else "CPU, fp32, no grouped GEMM: not the GPU number the issue asks for"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--strategy-part", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.strategy_part is not None:
        _strategy_part(args.strategy_part)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    print(f"gpu_check: {'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'no CUDA device: CPU parts only'}",
          flush=True)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "strategy": lambda: strategy_end_to_end(cuda), "oom_explain": lambda: oom_explain(cuda),
        "doctor": lambda: doctor(cuda), "layer_throughput": lambda: layer_throughput(cuda, args.repeats)}
    results: dict[str, Any] = {}
    for name, part in parts.items():
        t0 = time.perf_counter()
        try:
            result = part()
        except Exception as err:  # noqa: BLE001 - one part failing must not hide the others
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = result
        status = "skipped" if "skipped" in result else ("ok" if result.get("ok") else "FAILED")
        detail = result.get("skipped") or result.get("error") or result.get("note") or ""
        extra = f" ratio {result['ratio_median']:.2f}" if "ratio_median" in result else ""
        print(f"[{name}] {status}{extra} ({result['seconds']} s){': ' + detail if detail else ''}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"cuda": cuda, "parts": results}, indent=1, default=str))
    return 1 if any(not r.get("ok") and "skipped" not in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
