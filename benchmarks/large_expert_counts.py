"""Setup cost and planner answers at the expert counts of transformers 5.25's new MoE types.

The three types of issue 34 at their released sizes (their configs' defaults): kolibri1_1 (384
experts, top-6, hidden 2560), minicpm5_moe (160 experts, top-16, hidden 2048) and ergo (256
experts, top-8, hidden 8192). Each case runs in a child process of its own, so its peak memory is
its own (``VmHWM`` from ``/proc/self/status``):

* **meta**: the whole model built on the meta device, then discovery (``discover``), the probe's
  token count (``probe_tokens``) and the planner (``plan`` at ep_size 8/16/32 on 4 nodes of 8 GPUs,
  80 GB each; ``choose_ep_size`` for ``ep_size="auto"``) on it: wall seconds and peak memory.
* **layer**: one real MoE layer at the real hidden size, expert count and top-k (the experts'
  own width cut to ``--ffn``, so the layer fits a shared CPU machine), built on CPU in fp32;
  discovery and the conversion probe (``check_conversion``, as each rank runs it before
  ``deepspeed.initialize``), ``--repeats`` times: the median and every run, and the peak memory.
  Kolibri-1.1's score-correction bias is zero here (built from its config), so it converts; Ergo
  falls back at discovery (ungated experts), so it has nothing to probe.

    python benchmarks/large_expert_counts.py                     # all three, meta and layer
    python benchmarks/large_expert_counts.py --types kolibri1_1 --ffn 128 --repeats 5

Needs transformers >= 5.25 (the three types). Prints one line per case and a JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TYPES = ("kolibri1_1", "minicpm5_moe", "ergo")
EP_SIZES = (8, 16, 32)


def _memory() -> dict[str, float]:
    """Resident and peak resident set of this process, GB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}


def _config(model_type: str, layers: int | None = None, ffn: int | None = None) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    if layers is not None:  # one MoE layer, nothing dense before it
        config.num_hidden_layers = layers
        types = config.layer_types[:layers] if getattr(config, "layer_types", None) else None
        for attr, value in (("mlp_only_layers", []), ("num_dense_blocks", 0), ("first_k_dense_replace", 0),
                            ("mlp_layer_types", ["sparse"] * layers), ("layer_types", types)):
            if hasattr(config, attr) and value is not None:
                setattr(config, attr, value)
        if model_type == "kolibri1_1":
            config.index_layers, config.kv_source_layers = [], list(range(layers))
            config.layer_types = ["sliding_attention"] * layers
        config.vocab_size = 1024
    if ffn is not None:
        config.moe_intermediate_size = ffn
        for attr in ("shared_intermediate_size", "shared_expert_intermediate_size", "first_dense_intermediate_size"):
            if hasattr(config, attr):
                setattr(config, attr, ffn)
    return config


def meta_case(model_type: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_zeromoe.conversion.probe import probe_tokens
    from lightning_zeromoe.discovery.find import discover
    from lightning_zeromoe.planner import choose_ep_size, plan
    from lightning_zeromoe.planner.setups import LADDER

    before = _memory()
    t0 = time.perf_counter()
    config = _config(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = discover(model)
    t_discover = time.perf_counter() - t0
    blocks = found.blocks or [b.layout for b in found.fallback]
    num_experts = blocks[0].num_experts
    top_k = config.num_experts_per_tok
    zero3 = next(s for s in LADDER if s.stage == 3 and not s.offload_optimizer)
    per_ep = {}
    t0 = time.perf_counter()
    for ep in EP_SIZES:
        p = plan(model, num_gpus=32, gpus_per_node=8, gpu_memory_bytes=80e9, ep_size=ep)
        per_ep[ep] = {"local_experts": num_experts / ep, "zero3_gb_per_gpu": round(p.device_bytes(zero3) / 1e9, 1),
                      "fits_zero3": p.fits(zero3)}
    t_plan = time.perf_counter() - t0
    auto = {}
    for world, per_node in ((32, 8), (24, 8), (12, 6), (40, 8)):
        ep, why = choose_ep_size(model, [b.num_experts for b in blocks], world_size=world, devices_per_node=per_node,
                                 device_memory_bytes=80e9, stage=3)
        auto[f"{world} GPUs, {per_node}/node"] = {"ep_size": ep, "divides_E": num_experts % ep == 0,
                                                   "why": why[:160]}
    return {"case": "meta", "type": model_type, "experts": num_experts, "top_k": top_k,
            "hidden": config.hidden_size, "layers": config.num_hidden_layers,
            "converts": len(found.blocks), "fallback": len(found.fallback),
            "fallback_reason": found.fallback[0].reason[:120] if found.fallback else None,
            "probe_tokens": probe_tokens(num_experts, top_k), "build_s": round(t_build, 2),
            "discover_s": round(t_discover, 2), "plan_3_ep_sizes_s": round(t_plan, 2), "per_ep": per_ep,
            "auto": auto, "peak_gb": round(_memory()["VmHWM"], 2), "peak_gb_before": round(before["VmHWM"], 2)}


def layer_case(model_type: str, ffn: int, repeats: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_zeromoe.conversion.check import check_conversion
    from lightning_zeromoe.discovery.find import discover

    torch.manual_seed(0)
    before = _memory()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(_config(model_type, layers=1, ffn=ffn)).float()
    t_build = time.perf_counter() - t0
    built = _memory()
    times, discover_s, checks = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = discover(model)
        discover_s.append(time.perf_counter() - t0)
        if not found.blocks:
            break
        t0 = time.perf_counter()
        _, checks = check_conversion(model, found)
        times.append(time.perf_counter() - t0)
    report = checks[0].report if checks and checks[0].report is not None else None
    return {"case": "layer", "type": model_type, "ffn": ffn, "experts": found.blocks[0].num_experts
            if found.blocks else found.fallback[0].layout.num_experts,
            "build_s": round(t_build, 2), "discover_s_median": round(statistics.median(discover_s), 3),
            "probe_s_median": round(statistics.median(times), 2) if times else None,
            "probe_s_runs": [round(t, 2) for t in times], "passed": [c.passed for c in checks],
            "probe_tokens": report.tokens if report else None, "experts_hit": report.experts_hit if report else None,
            "errors": {k: float(f"{v:.2g}") for k, v in report.errors.items()} if report else None,
            "fallback_reason": found.fallback[0].reason[:120] if found.fallback else None,
            "model_gb": round(built["VmRSS"] - before["VmRSS"], 2), "peak_gb": round(_memory()["VmHWM"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--cases", nargs="+", default=["meta", "layer"])
    parser.add_argument("--ffn", type=int, default=64, help="the experts' width in the layer case (real: 512+)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "TYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, model_type = args.child
        result = meta_case(model_type) if case == "meta" else layer_case(model_type, args.ffn, args.repeats)
        print(json.dumps(result))
        return
    for case in args.cases:
        for model_type in args.types:
            cmd = [sys.executable, __file__, "--child", case, model_type, "--ffn", str(args.ffn),
                   "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
            if proc.returncode or line is None:
                print(f"{case} {model_type}: failed\n{proc.stderr[-3000:]}")
                continue
            print(line)


if __name__ == "__main__":
    main()
