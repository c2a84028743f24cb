"""Does the step-time model rank setups in the order they really run? Measured on CPU ranks (gloo).

The model (``lightning_zeromoe/planner/step_time.py``) predicts seconds per optimizer step from FLOPs
per token, the bytes of :mod:`lightning_zeromoe.planner.comm` and each link's bandwidth and latency.
Absolute CPU figures say nothing about GPUs; what this checks is the *ranking*: with ``Hardware``
set from this machine's own measured numbers, is the predicted order of setups the measured order?

Method, in one launch (``torch.distributed.run``, gloo):

1. Links: each collective DeepSpeed uses (``deepspeed.comm``'s ``all_reduce``,
   ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``) is timed at
   4 KB and at 4, 16 and 32 MB (median of ``--link-repeats`` calls after one warm-up; every rank
   calls at once), on the world group and on groups of each smaller size (4 ranks: pairs). Latency: the 4 KB time. Bus bandwidth: least squares of
   ``bytes * factor`` against ``time - latency`` over the large sizes (factor as in
   ``nccl-tests``: ``2(n-1)/n`` all-reduce, ``(n-1)/n`` the others).
2. Compute: every rank at once times 60 384 x 384 fp32 matmuls in a row (FLOP/s per rank while all
   ranks share the cores, as in training: each timed call lasts longer than a scheduler's time slice)
   and 5 AdamW steps on 2M elements (updates per second).
3. Setups: for each ``s<stage>e<ep_size>`` a raw DeepSpeed engine is built from the config
   ``ZeroMoEStrategy`` builds (``lightning_zeromoe.config.deepspeed.build_config``; AutoEP converts
   the MoE blocks at ``ep_size > 1``) around the reference ``TinyMoELM``, and trained for
   ``--warmup`` steps. All engines live side by side; then ``--steps`` rounds each run one
   optimizer step (``--accumulation`` micro-batches) of every setup, in an order rotated every
   round, so that the machine's changing load (it is shared) falls on all setups alike. A step is
   timed between two barriers, wall time on rank 0; the measured step time is the median.
4. Prediction: ``predict_step_time`` with ``Hardware`` from 1-2 (the measured link per collective,
   FLOP/s, update rate), the model's own tensor sizes and the engine's bucket sizes, and the host
   work rates of a separate one-rank run, where nothing communicates, so nothing of the ranking under
   test goes into them (``--calibrate``, see :func:`calibrate`): the gradient staging rate (s2e1
   minus s1e1: one more staging of the whole gradient per micro-batch), ZeRO-3's work per module
   pass (s3e1 minus s1e1, less the staging they differ by) and the expert loop's two rates (s1e1
   with 8, 4 and 2 experts: the reference block and AutoEP's layer without grouped GEMM both loop
   over slices of fused expert tensors,
   ``ModelShape(expert_loop="slices")``). Host work is CPU time: where ranks share cores it
   stretches as the matmul does, so the calibration is scaled by one rank's matmul rate over this
   run's (1.07 on 2 ranks on 2 cores; 1.89-2.20 on 4 in the runs of docs/concepts/models.md).
   Printed: predicted and measured seconds and ranks per setup, and Spearman's rank correlation
   (average ranks for ties, written here: no scipy in this environment).

Run from the repository root (``--json`` to keep the figures)::

    PYTHONPATH=$PWD .venv/bin/python -m torch.distributed.run --nproc_per_node 1 benchmarks/rank_setups.py \
        --calibrate --json calibration.json
    PYTHONPATH=$PWD .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/rank_setups.py \
        --calibration calibration.json
    PYTHONPATH=$PWD .venv/bin/python -m torch.distributed.run --nproc_per_node 4 benchmarks/rank_setups.py \
        --setups s1e1,s2e1,s3e1,s1e2,s3e2,s1e4,s3e4 --calibration calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_zeromoe.planner.step_time import Hardware, Link, ModelShape, bus_factor, predict_step_time  # noqa: E402

SIZES = (4 * 1024, 4 * 2**20, 16 * 2**20, 32 * 2**20)


def _timed(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the slowest rank's time is the collective's: take the max over ranks of each median
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure_links(repeats: int) -> dict[str, dict[str, Any]]:
    """Latency and bus bandwidth per collective, on the world group (key ``name``) and on groups of
    every smaller size > 1 that divides the world (``name/size``: consecutive ranks, all groups at
    once, as the expert-parallel groups run)."""
    import deepspeed.comm as dscomm

    world = dist.get_world_size()
    out: dict[str, dict[str, Any]] = {}
    if world == 1:  # nothing travels (the --calibrate run)
        return {name: {"latency": 0.0, "bandwidth": float("inf"), "points": []}
                for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    sizes = [g for g in range(2, world + 1) if world % g == 0]
    groups: dict[int, Any] = {world: None}
    for g in sizes[:-1]:
        for start in range(0, world, g):
            group = dist.new_group(list(range(start, start + g)))
            if start <= dist.get_rank() < start + g:
                groups[g] = group
    for g in sizes:
        group = groups[g]
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            points = []
            for nbytes in SIZES:
                n = max(g, nbytes // 4 // g * g)
                full = torch.ones(n)
                part = torch.ones(n // g)
                if name == "all_reduce":
                    def fn() -> None: dscomm.all_reduce(full, group=group)
                elif name == "all_gather":
                    def fn() -> None: dscomm.all_gather_into_tensor(full, part, group=group)
                elif name == "reduce_scatter":
                    def fn() -> None: dscomm.reduce_scatter_tensor(part, full, group=group)
                else:
                    out_t = torch.empty(n)
                    def fn() -> None: dscomm.all_to_all_single(out_t, full, group=group)
                points.append((n * 4, _timed(fn, repeats)))
            latency = points[0][1]
            xs = [b * bus_factor(name, g) for b, _ in points[1:]]
            ys = [max(t - latency, 1e-9) for _, t in points[1:]]
            seconds_per_byte = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
            key = name if g == world else f"{name}/{g}"
            out[key] = {"latency": latency, "bandwidth": 1 / seconds_per_byte, "points": [[b, t] for b, t in points]}
    return out


def measure_compute(repeats: int) -> dict[str, float]:
    """FLOP/s and optimizer updates/s per rank while every rank computes. Each timed call lasts
    ~0.1 s (60 matmuls; 5 AdamW steps), longer than a scheduler's time slice, so that ranks sharing
    a core (4 ranks on 2 cores) see each other: one short matmul after a barrier often runs alone."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    matmuls, updates = 60, 5

    def many() -> None:
        for _ in range(matmuls):
            a @ b

    t = _timed(many, repeats)
    param = torch.nn.Parameter(torch.zeros(2_000_000))
    param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3, foreach=False)

    def steps() -> None:
        for _ in range(updates):
            opt.step()

    u = _timed(steps, repeats)
    return {"flops_per_second": matmuls * 2 * 384**3 / t, "update_params_per_second": updates * param.numel() / u}


def build_setup(name: str, args: argparse.Namespace, experts: int | None = None) -> tuple[Any, dict[str, Any]]:
    """A raw DeepSpeed engine for ``s<stage>e<ep_size>`` with the strategy's config, and what the
    prediction needs (the model's tensor sizes before AutoEP, the ZeRO section). ``experts``: another
    expert count than ``--experts`` (the calibration's models with fewer experts)."""
    import argparse as ap

    import deepspeed

    from lightning_zeromoe.config.deepspeed import ZeroOptions, build_config
    from lightning_zeromoe.discovery.find import discover
    from lightning_zeromoe.planner import count_params, is_expert_param
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    stage, ep = int(name[1]), int(name[3])
    torch.manual_seed(0)
    cfg = TinyMoEConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
                        num_experts=experts or args.experts, top_k=2, ffn_hidden_size=args.ffn, max_seq_len=args.seq)
    model = TinyMoELM(cfg)
    counts = count_params(model)
    order = tuple((p.numel(), is_expert_param(n), n.rpartition(".")[0]) for n, p in model.named_parameters())
    config = build_config(ZeroOptions(stage=stage, ep_size=ep), discover(model, None).autoep if ep > 1 else None,
                          use_grouped_mm=False)
    config.update({"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accumulation,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}}})
    engine, *_ = deepspeed.initialize(args=ap.Namespace(device_rank=int(os.environ.get("LOCAL_RANK", 0))),
                                      model=model, model_parameters=list(model.parameters()), config=config,
                                      dist_init_required=False)
    return engine, {"counts": [list(counts.dense), list(counts.expert)], "order": order,
                    "zero": config["zero_optimization"], "stage": stage, "ep": ep, "moe_layers": cfg.num_layers,
                    "hidden": cfg.hidden_size, "experts": cfg.num_experts, "vocab": cfg.vocab_size}


def timed_step(engine: Any, rec: dict[str, Any], args: argparse.Namespace, gen: torch.Generator) -> float:
    """One optimizer step (``accumulation`` micro-batches) between two barriers: seconds."""
    import torch.nn.functional as F

    batches = [torch.randint(0, rec["vocab"], (args.batch, args.seq + 1), generator=gen)
               for _ in range(args.accumulation)]
    dist.barrier()
    t0 = time.perf_counter()
    for ids in batches:
        logits, _ = engine(ids[:, :-1])
        engine.backward(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))
        engine.step()
    dist.barrier()
    return time.perf_counter() - t0


def _shape(rec: dict[str, Any], args: argparse.Namespace) -> Any:
    from lightning_zeromoe.planner.comm import CommShape
    from lightning_zeromoe.planner.counts import ParamCounts

    zero = rec["zero"]
    return CommShape(counts=ParamCounts(tuple(rec["counts"][0]), tuple(rec["counts"][1])), stage=rec["stage"],
                      world=dist.get_world_size(), ep_size=rec["ep"], precision="fp32", top_k=2,
                      hidden_size=rec["hidden"], moe_layers=rec["moe_layers"], num_experts=rec["experts"],
                      tokens_per_micro_batch=args.batch * args.seq, accumulation=args.accumulation,
                      reduce_bucket_size=int(zero.get("reduce_bucket_size", 50_000_000)),
                      allgather_bucket_size=int(zero.get("allgather_bucket_size", 50_000_000)),
                      param_persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 100_000)),
                      prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", 50_000_000)),
                      max_reuse_distance=int(zero.get("stage3_max_reuse_distance", 1_000_000_000)),
                      param_order=tuple(tuple(o) for o in rec["order"]), lightning=False)


def predict(rec: dict[str, Any], hw: Hardware, args: argparse.Namespace) -> Any:
    # the reference block loops over its experts, and AutoEP without grouped GEMM (fp32, CPU) over its own
    model = ModelShape(attention_layers=rec["moe_layers"], seq_len=args.seq, expert_loop="slices",
                       autoep_expert_loop="slices")
    return predict_step_time(_shape(rec, args), hw, model=model)


def calibrate(records: dict[str, Any], meas: dict[str, float], hw: Hardware, args: argparse.Namespace) -> dict[str, Any]:
    """The host-work rates of one rank, where nothing communicates (module docstring, step 4).

    Gradient staging: s2e1 stages the whole gradient once per micro-batch, s1e1 once per step, so
    s2e1 minus s1e1 is ``accumulation - 1`` stagings. ZeRO-3: s3e1 minus s1e1, less the stagings
    s3e1 does beyond s1e1's, per module pass. The expert loop: s1e1 with E, E/2 and E/4 experts (the
    same FLOPs per token: top-2 of any). What the model predicts without the loop (the optimizer's
    update of more or fewer experts) is subtracted; what is left, up to a constant, is
    ``L * A * E * (f + 4 * b_E / bandwidth)`` with ``b_E`` one layer's expert bytes. Two differences
    give ``f`` and ``1 / bandwidth``; where the fit gives a negative ``f``, ``f = 0`` and the
    bandwidth is fitted alone (least squares), since a cost cannot be negative."""

    from lightning_zeromoe.planner.step_time import module_count

    modules = module_count(_shape(records["s3e1"], args))
    gradient_bytes = sum(map(sum, records["s1e1"]["counts"])) * 4  # fp32
    extra = meas["s2e1"] - meas["s1e1"]
    staging = (args.accumulation - 1) * gradient_bytes / extra if extra > 0 else float("inf")
    per_pass = ((meas["s3e1"] - meas["s1e1"] - (args.accumulation - 1) * gradient_bytes / staging)
                / (2 * args.accumulation * modules))
    bare = replace(hw, expert_loop_seconds=0.0, memory_bandwidth=float("inf"), gradient_staging_bandwidth=staging)
    names = ["s1e1", "s1e1/2", "s1e1/4"]
    experts = {n: records[n]["experts"] for n in names}
    rest = {n: meas[n] - predict(records[n], bare, args).total for n in names}
    passes = args.layers * args.accumulation
    layer_bytes = {n: sum(records[n]["counts"][1]) * 4 / records[n]["moe_layers"] for n in names}  # fp32 gradients
    # rest[a] - rest[b] = passes * ((E_a - E_b) * f + 4 * (E_a b_a - E_b b_b) * x), x = 1 / bandwidth
    rows = [(passes * (experts[a] - experts[b]), passes * 4 * (experts[a] * layer_bytes[a] - experts[b] * layer_bytes[b]),
             rest[a] - rest[b]) for a, b in (("s1e1", "s1e1/2"), ("s1e1/2", "s1e1/4"))]
    (a1, b1, y1), (a2, b2, y2) = rows
    det = a1 * b2 - a2 * b1
    f, x = (y1 * b2 - y2 * b1) / det, (a1 * y2 - a2 * y1) / det
    if f < 0:
        f, x = 0.0, (b1 * y1 + b2 * y2) / (b1 * b1 + b2 * b2)
    report = (f"calibration (1 rank): s1e1 {meas['s1e1']:.4f} s, s2e1 {meas['s2e1']:.4f} s, s3e1 "
              f"{meas['s3e1']:.4f} s; s1e1 with "
              + ", ".join(f"{experts[n]} experts {meas[n]:.4f} s" for n in names) + " per step\n"
              f"  gradient staging: {gradient_bytes / 1e6:.1f} MB per staging at {staging / 1e9:.2f} GB/s\n"
              f"  ZeRO-3 host work: {modules} modules x 2 passes x {args.accumulation} micro-batches: "
              f"{per_pass * 1e6:.0f} us per module pass\n"
              f"  expert loop: {f * 1e6:.0f} us per expert, full-size slice gradients at "
              f"{1 / x / 1e9 if x > 0 else float('inf'):.2f} GB/s effective")
    # the model before the staging term charged all of s3e1 minus s1e1 to ZeRO-3's module passes
    unstaged = (meas["s3e1"] - meas["s1e1"]) / (2 * args.accumulation * modules)
    return {"zero3_module_seconds": per_pass, "expert_loop_seconds": f, "gradient_staging_bandwidth": staging,
            "zero3_module_seconds_unstaged": unstaged,
            "memory_bandwidth": 1 / x if x > 0 else float("inf"), "modules": modules, "report": report}


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks."""
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="s1e1,s2e1,s3e1,s1e2,s2e2,s3e2")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per setup, one per round (default 12; 24 with --calibrate, whose "
                             "differences are small against the noise)")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--link-repeats", type=int, default=5)
    parser.add_argument("--same-batches", action="store_true",
                        help="every rank draws the same batches (equal routing, so no rank waits for a slower one)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--calibrate", action="store_true",
                        help="one rank, no communication: measure the gradient staging rate (s2e1 minus s1e1), "
                             "ZeRO-3's host work per module pass (s3e1 minus s1e1) and the expert loop's two "
                             "rates (s1e1 with all, half and a quarter of the experts); write them to --json")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="the --json file of a --calibrate run (default: the model's GPU assumptions)")
    args = parser.parse_args()
    if args.calibrate:
        args.setups = "s1e1,s2e1,s3e1,s1e1/2,s1e1/4"
    if args.steps is None:
        args.steps = 24 if args.calibrate else 12
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    load = os.getloadavg()
    links = measure_links(args.link_repeats)
    compute = measure_compute(args.link_repeats)
    # Host work is CPU time: where the ranks share cores (4 ranks on 2), it stretches as the matmul
    # does. Scale the one-rank calibration by that measured slowdown.
    extra: dict[str, float] = {}
    contention = 1.0
    if args.calibration is not None:
        cal = json.loads(args.calibration.read_text())
        if "gradient_staging_bandwidth" not in cal:
            raise SystemExit(f"{args.calibration} comes from an older --calibrate run without the gradient "
                             "staging rate: run --calibrate again")
        contention = max(1.0, cal["flops_per_second"] / compute["flops_per_second"])
        extra = {"zero3_module_seconds": cal["zero3_module_seconds"] * contention,
                 "expert_loop_seconds": cal["expert_loop_seconds"] * contention,
                 "memory_bandwidth": cal["memory_bandwidth"] / contention,
                 "gradient_staging_bandwidth": cal["gradient_staging_bandwidth"] / contention}
    hw = Hardware(flops_per_second=compute["flops_per_second"], **extra,
                  intra=Link(links["all_reduce"]["bandwidth"], links["all_reduce"]["latency"]),
                  update_params_per_second=compute["update_params_per_second"],
                  collective_links=tuple((k, Link(v["bandwidth"], v["latency"])) for k, v in links.items()))
    if rank == 0:
        print(f"{world} ranks, load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
        for k, v in links.items():
            print(f"  {k:17s} latency {v['latency'] * 1e3:7.2f} ms  bus bandwidth {v['bandwidth'] / 1e9:6.3f} GB/s")
        print(f"  matmul {compute['flops_per_second'] / 1e9:.2f} GFLOP/s per rank, AdamW "
              f"{compute['update_params_per_second'] / 1e6:.1f} M updates/s per rank", flush=True)
        if args.calibration is not None:
            print(f"  host work from {args.calibration} x {contention:.2f} (one rank's matmul rate / this run's): "
                  f"ZeRO-3 {hw.zero3_module_seconds * 1e6:.0f} us per module pass, expert loop "
                  f"{hw.expert_loop_seconds * 1e6:.0f} us per expert, slice gradients at "
                  f"{hw.memory_bandwidth / 1e9:.2f} GB/s, gradient staging at "
                  f"{hw.gradient_staging_bandwidth / 1e9:.2f} GB/s", flush=True)
    names = [n for n in args.setups.split(",") if n]
    # Every engine is built first and warmed up; then the timed steps go round the setups, one step
    # each, in an order rotated every round, so that a change of load falls on every setup alike.
    gen = torch.Generator().manual_seed(1 if args.same_batches else 1 + rank)
    engines, records = {}, {}
    for name in names:
        start = time.perf_counter()
        # "s1e1/2": that setup with half the experts (the calibration)
        fewer = args.experts // int(name[5:]) if "/" in name else None
        engines[name], records[name] = build_setup(name[:4], args, fewer)
        for _ in range(args.warmup):
            timed_step(engines[name], records[name], args, gen)
        if rank == 0:
            print(f"  {name}: built and warmed up in {time.perf_counter() - start:.0f} s", flush=True)
    measured: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            measured[name].append(timed_step(engines[name], records[name], args, gen))
    for engine in engines.values():
        engine.destroy()
    meas = {n: statistics.median(measured[n]) for n in names}
    if args.calibrate:
        calibration = calibrate(records, meas, hw, args)
        if rank == 0:
            print(calibration.pop("report"))
            if args.json:
                args.json.write_text(json.dumps(calibration | {"flops_per_second": compute["flops_per_second"],
                                                               "measured": measured, "load": [load, os.getloadavg()]},
                                                indent=1))
        dist.destroy_process_group()
        return 0
    preds = {n: predict(records[n], hw, args) for n in names}
    rho = spearman([preds[n].total for n in names], [meas[n] for n in names])
    # Side by side: the same run ranked by the model without the gradient-staging term.
    unstaged_hw = replace(hw, gradient_staging_bandwidth=float("inf"), zero3_module_seconds=(
        cal["zero3_module_seconds_unstaged"] * contention if args.calibration is not None else hw.zero3_module_seconds))
    unstaged = [predict(records[n], unstaged_hw, args).total for n in names]
    rho_unstaged = spearman(unstaged, [meas[n] for n in names])
    if rank == 0:
        pr, mr = ranks([preds[n].total for n in names]), ranks([meas[n] for n in names])
        print("\n| setup | predicted s/step (compute + comm + expert loop + staging + ZeRO-3 host) "
              "| measured s/step (median) "
              "| predicted rank | measured rank |")
        print("|---|---:|---:|---:|---:|")
        for i, n in enumerate(names):
            p = preds[n]
            print(f"| {n} | {p.total:.3f} ({p.compute:.3f} + {p.comm_total:.3f} + {p.expert_loop:.3f} + "
                  f"{p.gradient_staging:.3f} + {p.zero3_host:.3f}) | {meas[n]:.3f} "
                  f"| {pr[i]:g} | {mr[i]:g} |")
        print(f"Spearman rho ({world} ranks, {len(names)} setups): {rho:.3f}; without the gradient-staging term "
              f"{rho_unstaged:.3f} (predicted ranks {' '.join(f'{r:g}' for r in ranks(unstaged))}); load average at "
              f"end {os.getloadavg()[0]:.2f}")
        if args.json:
            args.json.write_text(json.dumps({"world": world, "links": links, "compute": compute, "rho": rho,
                                             "rho_without_staging": rho_unstaged,
                                             "measured": measured, "load": [load, os.getloadavg()],
                                             "predicted": {n: {"total": p.total, "compute": p.compute,
                                                               "comm": p.comm_total, "zero3_host": p.zero3_host,
                                                               "gradient_staging": p.gradient_staging,
                                                               "expert_loop": p.expert_loop}
                                                           for n, p in preds.items()},
                                             "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
