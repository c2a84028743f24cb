"""What does training through ``ZeroMoEStrategy`` + the Lightning Trainer cost over raw DeepSpeed?

Two ways of training the same tiny MoE (``lightning_zeromoe.reference.models.TinyMoELM``, default
``TinyMoEConfig``: 2 layers, 4 experts, top-2) with ZeRO-3 + AutoEP on ``--nproc`` CPU ranks (gloo):

(a) ``lightning``: ``L.Trainer(accelerator="cpu", devices=2, strategy=ZeroMoEStrategy(ep_size=2))``
    fitting ``TinyMoEModule`` with the Trainer's defaults (progress bar, logger; checkpointing off).
    Started as ``python strategy_overhead.py --mode lightning ...``; Lightning re-runs the script
    for rank 1.
(a') ``together``: the same script as (a), with every rank started at once by this script (the
    variables torchrun sets: MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK; no agent process), so
    Lightning launches nothing. Only its time to first step is reported: it isolates what (a)'s
    serial start of rank 1 costs.
(b) ``raw``: a hand-written loop: ``deepspeed.init_distributed("gloo")``, ``deepspeed.initialize``,
    then ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``. Both ranks are started at
    once by this script with MASTER_ADDR/PORT, RANK, WORLD_SIZE and LOCAL_RANK set.

Both get the *identical* DeepSpeed config: the first (a) run writes the config the strategy
actually handed to ``deepspeed.initialize`` (``trainer.strategy.config``) to JSON, and every (b)
run loads that file. Same model and initial weights (same seed), same data (``SyntheticLMData``
through the ``DistributedSampler(shuffle=True, seed=...)`` that Lightning injects into every
training DataLoader), same micro-batch, optimizer (AdamW, lr 3e-3, no weight decay), loss
(task + 0.01 x aux, from ``lm_losses``), steps, ``DS_ACCELERATOR=cpu`` and ``OMP_NUM_THREADS``. The
per-step losses of (a) and (b) are compared at the end and must agree (fp32, deterministic): that
proves both did the same work. Runs are interleaved a, b, a, b, ... so slow drifts of the host hit
both alike.

Measured inside rank 0 (the ranks move in lock-step):

* **tokens/s**: global tokens (micro-batch x ranks x 32 input tokens) per second from the end of
  step ``--warmup`` to the end of the last step: everything a step costs (data, hooks, logging).
  "ratio, median step" is the same ratio from median step times instead of the mean.
* **Lightning-only ms/step** and **ratio, overhead-based**: the same calls are timed in both
  paths (``lm_losses`` = forward + loss, ``engine.backward``, ``engine.step``, and in (a)
  ``LightningModule.log``). What a step spends outside them is loop, hook and data time. Lightning-
  only time = (a)'s outside time + its ``self.log`` time - (b)'s outside time, and the
  overhead-based ratio is ``1 - that / (a)'s step time``. It compares the two paths within the same
  steps' structure, so it is stable on a busy host where the plain ratio is not.
* **first step s**: from the moment the driver launched the run (rank 0's process start) to the
  end of the first optimizer step: interpreter start, imports, (a) Lightning starting rank 1 only
  once rank 0 reaches ``fit()``, process groups, AutoEP conversion, ZeRO-3 partitioning. The
  "Start-up" lines split it up.

How to read it: ratio = (a)/(b); 1.0 means Lightning adds nothing per step; the target is >= 0.97.
On a shared or small machine other processes make single runs swing by +-30%: trust the
overhead-based column and the medians, and rerun with ``--repeats 5`` before quoting the plain
ratio. The tiny model's step is almost all fixed per-step cost (Python, ZeRO-3 hooks, gloo latency;
a 4x larger batch barely changes the step time), so a fixed Lightning cost of a few ms per step
shows up here far more than it would on a real model, where the step does real compute. The time
to first step is a one-off cost; it matters for short jobs and tests, not for throughput.

Usage (repository root; ~3-6 min on 2 busy cores, mostly process start-up)::

    .venv/bin/python benchmarks/strategy_overhead.py
    .venv/bin/python benchmarks/strategy_overhead.py --repeats 5 --steps 60 --batch-size 16 --json out.json

``--lean`` runs (a) without progress bar, logger and model summary; ``--profile`` writes a cProfile
of the steps after warm-up for every rank of both paths (``profile-rank*.txt`` / ``.pstats`` in
the run directories printed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()  # as close to process start as Python lets us get

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 33  # TinyMoEModule's data: max_seq_len // 2 + 1 tokens, the model sees 32 of them
LR = 3e-3
SEED = 1234
#: (a) as a user starts it, (a') the same with all ranks started at once, (b) the raw loop.
MODES = ("lightning", "together", "raw")


# ---------------------------------------------------------------------------------------------
# shared by both ranks' code paths


def _num_samples(args: argparse.Namespace) -> int:
    # One epoch covers every step: no epoch boundary inside the timed window for either path.
    return args.steps * args.batch_size * args.nproc


def _tokens_per_step(args: argparse.Namespace) -> int:
    return args.batch_size * args.nproc * (SEQ_LEN - 1)


class _Segments:
    """Cumulative wall seconds spent inside a few wrapped calls, sampled at the end of each step.

    The same calls are wrapped in both paths (``lm_losses``: the model's forward and loss;
    ``engine.backward``; ``engine.step``; and in (a) also ``LightningModule.log``), so what is left
    of a step, "other", is loop, hook and data-loading time. Comparing the paths' "other" (plus
    (a)'s logging) within the same runs is far less sensitive to a noisy host than comparing
    tokens/s, because host noise inflates the shared compute of both paths alike.
    """

    KEYS = ("model", "backward", "optimizer", "log")

    def __init__(self) -> None:
        self.total = dict.fromkeys(self.KEYS, 0.0)
        self.samples: list[dict[str, float]] = []

    def wrap(self, owner: object, attr: str, key: str) -> None:
        fn = getattr(owner, attr)
        total = self.total

        def timed(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[key] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def sample(self) -> None:
        self.samples.append(dict(self.total))


def _write_result(args: argparse.Namespace, rank: int, step_end: list[float], step_end_wall: list[float],
                  step_cpu: list[float], losses: list[float], marks: dict[str, float], segments: _Segments) -> None:
    launch = float(os.environ.get("BENCH_LAUNCH_T", T_START))
    result = {
        "rank": rank,
        "launch": launch,
        "marks": {k: v - launch for k, v in marks.items()},
        "first_step_s": step_end_wall[0] - launch,
        "step_end": step_end,
        "step_cpu": step_cpu,
        "segments": segments.samples,
        "losses": losses,
        "threads": __import__("torch").get_num_threads(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# (a) ZeroMoEStrategy through the Lightning Trainer


def run_lightning(args: argparse.Namespace) -> None:
    marks = {"start": T_START}
    import lightning as L
    import torch

    from lightning_zeromoe import ZeroMoEStrategy

    from lightning_zeromoe.reference import models
    from lightning_zeromoe.reference.models import TinyMoEModule

    marks["imported"] = time.time()
    segments = _Segments()
    segments.wrap(models, "lm_losses", "model")  # TinyMoEModule.training_step looks it up there

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.step_end: list[float] = []
            self.step_end_wall: list[float] = []
            self.step_cpu: list[float] = []
            self.losses: list[torch.Tensor] = []

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            marks["engine_ready"] = time.time()
            engine = trainer.strategy.deepspeed_engine  # what Lightning's precision plugin calls
            segments.wrap(engine, "backward", "backward")
            segments.wrap(engine, "step", "optimizer")
            segments.wrap(pl_module, "log", "log")  # log_dict calls log
            if trainer.global_rank == 0 and args.dump_config:
                Path(args.dump_config).write_text(json.dumps(trainer.strategy.config, indent=2, sort_keys=True))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.step_end.append(time.perf_counter())
            self.step_end_wall.append(time.time())
            self.step_cpu.append(time.process_time())
            segments.sample()
            self.losses.append(outputs["loss"].detach())  # no .item() here: keep the step untouched

    L.seed_everything(SEED, verbose=False)
    module = TinyMoEModule(lr=LR, batch_size=args.batch_size, num_samples=_num_samples(args), seed=0)
    clock = Clock()
    profiler = None
    if args.profile:
        profiler = _lightning_callback_class()(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.nproc, strategy=ZeroMoEStrategy(ep_size=args.ep_size),
        max_steps=args.steps, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=[clock] + ([profiler] if profiler else []),
        default_root_dir=args.out,
        **({"enable_progress_bar": False, "logger": False, "enable_model_summary": False} if args.lean else {}),
    )
    trainer.fit(module)
    if profiler is not None:
        profiler.dump(Path(args.out) / f"profile-rank{trainer.global_rank}.txt")
    _write_result(args, trainer.global_rank, clock.step_end, clock.step_end_wall, clock.step_cpu,
                  [float(x) for x in clock.losses], marks, segments)


class _StepProfiler:
    """cProfile over the steps after warm-up (``--profile``); a Lightning callback."""

    def __init__(self, warmup: int) -> None:
        import cProfile

        self.warmup = warmup
        self.prof = cProfile.Profile()
        self.on = False

    # Lightning looks callbacks up by these hook names.
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx + 1 == self.warmup and not self.on:
            self.prof.enable()
            self.on = True

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self.on:
            self.prof.disable()
            self.on = False

    def dump(self, path: Path) -> None:
        import io
        import pstats

        buf = io.StringIO()
        stats = pstats.Stats(self.prof, stream=buf).sort_stats("cumulative")
        stats.print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        path.write_text(buf.getvalue())
        self.prof.dump_stats(path.with_suffix(".pstats"))


def _lightning_callback_class() -> type:
    import lightning as L

    return type("StepProfiler", (_StepProfiler, L.Callback), {})


# ---------------------------------------------------------------------------------------------
# (b) hand-written deepspeed.initialize loop


def run_raw(args: argparse.Namespace) -> None:
    marks = {"start": T_START}
    import deepspeed
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_zeromoe.reference import models
    from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM

    marks["imported"] = time.time()
    segments = _Segments()
    segments.wrap(models, "lm_losses", "model")

    class Root(nn.Module):
        """Holds the LM as ``.model``, as TinyMoEModule does, so the config's AutoEP pattern
        (``model\\.layers\\.\\d+\\.mlp``) matches the same module names."""

        def __init__(self, config: TinyMoEConfig) -> None:
            super().__init__()
            self.model = TinyMoELM(config)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            task, aux = models.lm_losses(self.model, input_ids)
            return task.mean() + self.model.config.aux_loss_weight * aux.mean()

    config = json.loads(Path(args.config).read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(SEED)  # what seed_everything + Lightning's reset_seed do before the module exists
    root = Root(TinyMoEConfig())
    optimizer = torch.optim.AdamW(root.parameters(), lr=LR, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=root, model_parameters=[p for p in root.parameters()],
                                           optimizer=optimizer, config=config)
    data = SyntheticLMData(_num_samples(args), SEQ_LEN, root.model.config.vocab_size, seed=0)
    # What Lightning injects into a training DataLoader: shuffle=True, seed = PL_GLOBAL_SEED, epoch 0.
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    marks["engine_ready"] = time.time()
    segments.wrap(engine, "backward", "backward")
    segments.wrap(engine, "step", "optimizer")

    step_end, step_end_wall, step_cpu, losses = [], [], [], []
    profiler = _StepProfiler(args.warmup) if args.profile else None
    engine.train()
    batches = iter(loader)
    for step in range(args.steps):
        if profiler is not None and step == args.warmup:
            profiler.prof.enable()
        batch = next(batches)
        loss = engine(batch["input_ids"])
        engine.backward(loss)
        engine.step()
        step_end.append(time.perf_counter())
        step_end_wall.append(time.time())
        step_cpu.append(time.process_time())
        segments.sample()
        losses.append(loss.detach())
    if profiler is not None:
        profiler.prof.disable()
        profiler.dump(Path(args.out) / f"profile-rank{rank}.txt")
    _write_result(args, rank, step_end, step_end_wall, step_cpu, [float(x) for x in losses], marks, segments)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                        "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")}
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = str(args.threads)  # what Lightning and torchrun would pick; same for both
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _common_flags(args: argparse.Namespace, out: Path) -> list[str]:
    return [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--ep-size={args.ep_size}",
            f"--batch-size={args.batch_size}", f"--nproc={args.nproc}", f"--out={out}"] + (
        ["--profile"] if args.profile else [])


def _launch(cmds: list[list[str]], envs: list[dict[str, str]], log: Path, timeout: float) -> None:
    with open(log, "w") as fh:
        launch = time.time()
        procs = []
        for cmd, env in zip(cmds, envs):
            env = dict(env, BENCH_LAUNCH_T=repr(launch))
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise SystemExit(f"run timed out after {timeout:.0f}s; log: {log}")
    if any(codes):
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"run failed (exit codes {codes}); log: {log}\n{tail}")


def _launch_together(me: list[str], flags: list[str], env: dict[str, str], nproc: int) -> tuple[list, list]:
    """Every rank at once, with the variables torchrun would set (no agent process)."""
    port = str(_free_port())
    cmds, envs = [], []
    for rank in range(nproc):
        cmds.append(me + flags)
        envs.append(dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                         LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc)))
    return cmds, envs


def run_one(args: argparse.Namespace, mode: str, repeat: int, work: Path, config_path: Path) -> dict:
    out = work / f"{mode}-{repeat}"
    out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    env = _base_env(args)
    if mode == "lightning":  # `python script.py`: Lightning starts rank 1 when rank 0 reaches fit()
        flags = _common_flags(args, out) + (["--lean"] if args.lean else [])
        if not config_path.exists():
            flags.append(f"--dump-config={config_path}")
        _launch([me + ["--mode=lightning"] + flags], [env], out / "log.txt", args.run_timeout)
    elif mode == "together":  # the same script, every rank started at once (as torchrun does)
        flags = ["--mode=lightning"] + _common_flags(args, out) + (["--lean"] if args.lean else [])
        _launch(*_launch_together(me, flags, env, args.nproc), out / "log.txt", args.run_timeout)
    else:
        flags = ["--mode=raw", f"--config={config_path}"] + _common_flags(args, out)
        _launch(*_launch_together(me, flags, env, args.nproc), out / "log.txt", args.run_timeout)
    rank0 = json.loads((out / "rank0.json").read_text())
    summary = summarize(args, rank0)
    if args.nproc > 1:  # when the last rank started: Lightning launches it only once rank 0 reaches fit()
        last = json.loads((out / f"rank{args.nproc - 1}.json").read_text())
        summary["marks"][f"rank{args.nproc - 1}_start"] = last["marks"]["start"]
    return summary


def summarize(args: argparse.Namespace, r: dict) -> dict:
    t = r["step_end"]
    w = args.warmup
    window = t[-1] - t[w - 1]
    steps = len(t) - w
    tok = _tokens_per_step(args)
    step_times = [b - a for a, b in zip(t[w - 1:-1], t[w:])]
    seg0, seg1 = r["segments"][w - 1], r["segments"][-1]
    per_step = {k: 1e3 * (seg1[k] - seg0[k]) / steps for k in _Segments.KEYS}
    per_step["step"] = 1e3 * window / steps
    per_step["other"] = per_step["step"] - sum(per_step[k] for k in _Segments.KEYS)
    return {
        "ms_per_step": per_step,
        "tokens_per_s": tok * steps / window,
        "tokens_per_s_median_step": tok / statistics.median(step_times),
        "step_ms_median": 1e3 * statistics.median(step_times),
        # process CPU time per step (all threads of rank 0): less sensitive to other load on the host
        "cpu_ms_per_step": 1e3 * (r["step_cpu"][-1] - r["step_cpu"][w - 1]) / steps,
        "first_step_s": r["first_step_s"],
        "marks": r["marks"],
        "losses": r["losses"],
        "threads": r["threads"],
    }


def main_driver(args: argparse.Namespace) -> None:
    if args.warmup < 1 or args.steps - args.warmup < 5:
        raise SystemExit("--steps must exceed --warmup by at least 5 (and --warmup >= 1)")
    command = " ".join([".venv/bin/python", "benchmarks/strategy_overhead.py"] + sys.argv[1:])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="zeromoe-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "deepspeed_config.json"
    t0 = time.time()
    rows = []
    for repeat in range(1, args.repeats + 1):
        row = {}
        for mode in MODES:
            row[mode] = run_one(args, mode, repeat, work, config_path)
            s = row[mode]
            print(f"[repeat {repeat}] {mode:9s} {s['tokens_per_s']:8.0f} tok/s  "
                  f"(median step {s['step_ms_median']:.1f} ms, "
                  f"CPU {s['cpu_ms_per_step']:.1f} ms/step)"
                  f"  first step {s['first_step_s']:.1f} s", flush=True)
        rows.append(row)

    # Both paths must have done the same computation.
    ref = rows[0]["raw"]["losses"]
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12)
                    for row in rows for mode in row for a, b in zip(row[mode]["losses"], ref))

    med = statistics.median
    ratios = [r["lightning"]["tokens_per_s"] / r["raw"]["tokens_per_s"] for r in rows]
    ratios_ms = [r["lightning"]["tokens_per_s_median_step"] / r["raw"]["tokens_per_s_median_step"] for r in rows]
    # Lightning-only time per step: (a)'s loop/hook/data time and self.log, minus (b)'s loop/data time.
    extras = [r["lightning"]["ms_per_step"]["other"] + r["lightning"]["ms_per_step"]["log"]
              - r["raw"]["ms_per_step"]["other"] for r in rows]
    est = [1 - x / r["lightning"]["ms_per_step"]["step"] for x, r in zip(extras, rows)]
    lines = [
        f"ZeRO-3 + AutoEP ep_size={args.ep_size}, {args.nproc} CPU ranks (gloo), tiny MoE, micro-batch "
        f"{args.batch_size}/rank x {SEQ_LEN - 1} tokens, {args.steps} steps ({args.warmup} warm-up), "
        f"OMP_NUM_THREADS={args.threads}{', lean Trainer (no progress bar/logger/summary)' if args.lean else ''}.",
        "",
        "| repeat | (a) Lightning + ZeroMoEStrategy tok/s | (b) raw DeepSpeed tok/s | ratio (a)/(b) "
        "| ratio, median step | Lightning-only ms/step | ratio, overhead-based |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (row, ratio, ratio_ms, extra, e) in enumerate(zip(rows, ratios, ratios_ms, extras, est), 1):
        a, b = row["lightning"], row["raw"]
        lines.append(f"| {i} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | {ratio:.3f} | {ratio_ms:.3f} "
                     f"| {extra:.1f} | {e:.3f} |")
    lines.append(
        f"| **median** | **{med(r['lightning']['tokens_per_s'] for r in rows):.0f}** "
        f"| **{med(r['raw']['tokens_per_s'] for r in rows):.0f}** | **{med(ratios):.3f}** | **{med(ratios_ms):.3f}** "
        f"| **{med(extras):.1f}** | **{med(est):.3f}** |")
    first = {mode: [r[mode]["first_step_s"] for r in rows] for mode in MODES}
    lines += ["", "Time to first step (seconds from launch to the end of rank 0's first optimizer step):", "",
              "| repeat | (a) `python script.py` | (a') same script, ranks started together | (b) raw DeepSpeed "
              "| (a)/(b) | (a')/(b) |", "|---|---:|---:|---:|---:|---:|"]
    for i in range(len(rows)):
        a, t, b = (first[m][i] for m in MODES)
        lines.append(f"| {i + 1} | {a:.1f} | {t:.1f} | {b:.1f} | {a / b:.2f} | {t / b:.2f} |")
    a, t, b = (med(first[m]) for m in MODES)
    lines.append(f"| **median** | **{a:.1f}** | **{t:.1f}** | **{b:.1f}** | **{a / b:.2f}** | **{t / b:.2f}** |")
    keys = ("step", "model", "backward", "optimizer", "log", "other")
    lines += ["", "Where rank 0's step goes (wall ms per step after warm-up, median of repeats):", "",
              "| path | whole step | model forward + loss | engine.backward | engine.step | self.log "
              "| other (loop, hooks, data) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, label in (("lightning", "(a) Lightning"), ("raw", "(b) raw DeepSpeed")):
        lines.append(f"| {label} | " + " | ".join(f"{med(r[mode]['ms_per_step'][k] for r in rows):.1f}"
                                                  for k in keys) + " |")
    verdict = "meets" if med(ratios) >= 0.97 else "misses"
    same = (f"Per-step losses of (a) and (b) agree to {loss_diff:.1e} (relative): both trained the same model "
            "on the same data." if loss_diff < 1e-4 else
            f"WARNING: per-step losses of (a) and (b) differ by up to {loss_diff:.1e} (relative): the two paths "
            "did not do the same work, so the ratio is not meaningful.")
    lines += ["", f"Median ratio {med(ratios):.3f} {verdict} the target (>= 0.97); the overhead-based estimate is "
              f"{med(est):.3f} (Lightning-only work of {med(extras):.1f} ms per step). {same}", "",
              f"Command: `{command}` ({time.time() - t0:.0f} s wall)."]
    print()
    print("\n".join(lines))
    print("\nStart-up, repeat 1 (seconds from launch; rank 0 unless named):")
    for mode in MODES:
        marks = rows[0][mode]["marks"]
        print(f"  {mode:9s} " + "  ".join(f"{k}={v:.1f}" for k, v in marks.items())
              + f"  first_step={rows[0][mode]['first_step_s']:.1f}  torch threads={rows[0][mode]['threads']}")
    print(f"\nLogs and per-rank timings: {work}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratios": ratios, "overhead_ms": extras,
                                               "command": command}, indent=2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from tokens/s (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="(a, b) pairs, interleaved (default 3)")
    p.add_argument("--ep-size", type=int, default=2, help="expert-parallel size (default 2)")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank, sequences (default 8)")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks per run (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every rank of both paths (default: cores / nproc, as Lightning picks)")
    p.add_argument("--lean", action="store_true", help="(a) without progress bar, logger, model summary")
    p.add_argument("--profile", action="store_true", help="cProfile the steps after warm-up (both paths, per rank)")
    p.add_argument("--json", help="also write all measurements to this JSON file")
    p.add_argument("--work-dir", help="where runs write logs and timings (default: a new temp dir)")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds before a run is killed")
    p.add_argument("--mode", choices=("driver", "lightning", "raw"), default="driver", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--dump-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // args.nproc)
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.mode == "lightning":
        run_lightning(ARGS)
    elif ARGS.mode == "raw":
        run_raw(ARGS)
    else:
        main_driver(ARGS)
