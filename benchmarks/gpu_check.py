"""The checks only a GPU can answer, as one script (under 8 minutes on one GPU).

    python benchmarks/gpu_check.py [--json OUT.json] [--repeats 5]

One GPU cannot hold two NCCL ranks, so expert parallelism is exercised at ``autoep_size=1``
(AutoEP's layer, its router and its grouped-GEMM expert path; no all-to-all). Parts:

1. ``train_bf16``: ZeRO-3 + AutoEP (``autoep_size=1``, ``use_grouped_mm=True``) trains a tiny HF
   Mixtral in bf16 for 20 steps on one process through ``deepspeed.initialize`` directly (the
   strategy skips AutoEP at ``ep_size=1``). Checks: parameters are bf16, the MoE blocks became
   ``AutoEPMoELayer``, losses are finite and fall.
2. ``oom_explain``: a real ``torch.cuda.OutOfMemoryError`` (allocating more than the device has),
   its traceback fed to ``python -m troubleshooter explain --json``. Check: it matches the CUDA
   OOM entry.
3. ``doctor``: ``python -m troubleshooter doctor --json`` on this machine. Check: it runs, and
   reports its CUDA checks.
4. ``layer_throughput``: tokens/s of forward+backward of one MoE block, AutoEP's layer against HF's
   eager Mixtral block with the same weights, side by side, ``--repeats`` times; the median ratio.

On a machine without CUDA, parts 1 and 4 run on the CPU instead (fp32 and bf16 with
``use_grouped_mm=False``: torch's grouped GEMM is CUDA-only) and say so; part 2 is skipped (no
CUDA OOM to provoke), part 3 runs and its CUDA checks report no GPU. Each part prints one line
``[part] status: ...`` (``ok``, ``FAILED`` or ``skipped``) and the script exits 1 if any failed.
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


def train_bf16(cuda: bool) -> dict[str, Any]:
    import argparse as ap

    import deepspeed
    import torch
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    from lightning_zeromoe.models import SyntheticLMData

    results = {}
    for bf16 in ((True,) if cuda else (False, True)):
        model = tiny_mixtral()
        engine, *_ = deepspeed.initialize(args=ap.Namespace(device_rank=0), model=model,
                                          model_parameters=list(model.parameters()),
                                          config=ds_config(bf16=bf16, grouped_mm=cuda))
        device = engine.device
        data = SyntheticLMData(num_samples=80, seq_len=17, vocab_size=128, seed=0)
        losses = []
        for step in range(20):
            ids = data.tokens[step * 4:(step + 1) * 4].to(device)
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
        layers = sum(isinstance(m, AutoEPMoELayer) for m in engine.module.modules())
        ok = all(map(lambda x: x == x and abs(x) < 1e4, losses)) and losses[-1] < losses[0] and layers == 2 \
            and dtypes == (["torch.bfloat16"] if bf16 else ["torch.float32"])
        results["bf16" if bf16 else "fp32"] = {"ok": ok, "first_loss": losses[0], "last_loss": losses[-1],
                                               "param_dtypes": dtypes, "autoep_layers": layers,
                                               "grouped_mm": cuda, "device": str(device)}
        engine.destroy()
    return {"ok": all(r["ok"] for r in results.values()), "runs": results,
            "note": "" if cuda else "CPU: no grouped GEMM (CUDA-only); AutoEP's per-expert loop instead"}


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

    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, tokens = (1024, 8192) if cuda else (256, 1024)
    model = tiny_mixtral(layers=1, hidden=hidden, experts=8)
    hf_block = copy.deepcopy(model.model.layers[0].mlp)
    hf_block.experts.config._experts_implementation = "eager"
    device = torch.device("cuda" if cuda else "cpu")
    hf_block = hf_block.to(device=device, dtype=dtype)
    config = ds_config(bf16=cuda, grouped_mm=cuda)
    config["zero_optimization"] = {"stage": 0}  # the layer alone: no gathers in the timing
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
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    print(f"gpu_check: {'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'no CUDA device: CPU parts only'}",
          flush=True)
    init_single_process(cuda)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "train_bf16": lambda: train_bf16(cuda), "oom_explain": lambda: oom_explain(cuda),
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
