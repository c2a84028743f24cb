"""Where a steady-state optimizer step's time goes: ``ZeroMoEStrategy`` against transformers' FSDP2 + EP.

The model, data, optimizer and launches are those of ``benchmarks/native_peer.py`` (a Mixtral-style causal
LM from a config, 26 M parameters at the defaults, fp32, AdamW, ``torchrun`` on localhost, gloo, one thread a
rank, ``ep_size`` = ranks). Each launch runs ``--warmup`` steps, ``--steps`` timed steps and then ``--profiled``
steps under ``torch.profiler``; every rank writes its records.

Per timed step, rank 0 (``time.perf_counter``):

* ``native`` (a plain loop): ``forward`` (model call with the loss), ``backward``, ``optimizer`` (``opt.step``),
  ``zero_grad`` and ``loop`` (the rest of the step: the data loader, recording the loss);
* ``zeromoe`` (Lightning + ``ZeroMoEStrategy``): ``forward`` is ``DeepSpeedEngine.forward`` (the
  LightningModule's ``training_step`` inside it, with ZeRO-3's pre/post-forward hooks), ``backward`` is
  ``DeepSpeedEngine.backward`` and ``optimizer`` is ``DeepSpeedEngine.step`` (each timed by wrapping the
  engine instance's method in ``on_train_start``); ``strategy`` is the strategy's own per-step work
  after the engine's step (``pitfalls.after_step``: the gradient audit of the first steps), and ``loop`` is
  the rest: Lightning's loop, hooks, ``self.log``-free callbacks, the data loader.

The profiled steps give the time inside each collective (``torch.profiler``'s CPU events whose names start with
``c10d::`` or ``gloo:``: the main thread's time in the call, which on gloo includes the wait for the other rank
unless the op is asynchronous, and then the wait shows as ``c10d::wait``-named time or inside the op that
waits), per step and rank 0, and the count of calls. Profiling slows both sides; the split in milliseconds
comes from the unprofiled steps, the collectives' share from the profiled ones.

``--variant NAME=JSON`` adds a ``zeromoe`` side with those keyword arguments to ``ZeroMoEStrategy``: a lever
measured beside the default, interleaved. Two keys are the benchmark's own: ``"_env"`` (a dict of environment
variables for that launch, e.g. glibc's ``GLIBC_TUNABLES``), ``"_side": "native"`` (the variant is the
native side, with ``_env``) and ``"_skip_one_rank_reduce_scatter": true`` (a measurement only, not in the
package: DeepSpeed's ``reduce_scatter_coalesced`` returns the gradients themselves, flattened, for a group of one
rank, where it would concatenate them, divide by 1 and reduce-scatter over that one rank: bit for bit the same
result without the copies).

``--adamw`` measures one term alone, in this process (one thread): torch's ``AdamW.step`` over one rank's expert
parameters of the default model (4 layers x 4 local experts, 12.6 M fp32 elements) held the two ways the sides hold
them: as per-layer tensors (transformers' ``gate_up_proj`` and ``down_proj``, 2.1 M and 1.0 M elements) and as one
flat tensor (DeepSpeed's fp32 partition of a sub group, ``sub_group_size`` 1e9 by default), and as flat pieces of
``--adamw-piece`` elements (``sub_group_size``); ``--repeats`` rounds of ``--steps`` steps each, the layouts
interleaved, with and without glibc's ``mmap`` for large blocks (``GLIBC_TUNABLES=glibc.malloc.mmap_max=0``, in a
child process).

Every side's per-step loss must equal a plain single-process run's within ``--tolerance`` (as in
``native_peer.py``); the driver exits 1 otherwise, after printing the tables. Medians over ``--repeats``
launches per side; each repeat launches every side once, the order rotating; ratios paired by repeat.

    .venv/bin/python benchmarks/step_profile.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import native_peer  # noqa: E402  (the model, data, sampler and plain reference run of the peer benchmark)

PARTS = ("forward", "backward", "optimizer", "zero_grad", "strategy", "loop")


@dataclass
class StepRecord:
    """One rank of one launch: per timed step, milliseconds by part; per profiled step, collectives."""

    side: str
    rank: int
    losses: list[float] = field(default_factory=list)
    steps_ms: list[dict[str, float]] = field(default_factory=list)
    inner_ms: list[dict[str, float]] = field(default_factory=list)  # named pieces inside the parts, per step
    comm_ms: dict[str, float] = field(default_factory=dict)  # per profiled step, by event name
    comm_calls: dict[str, float] = field(default_factory=dict)
    profiled_step_ms: float = 0.0
    top_ops: list[tuple[str, float]] = field(default_factory=list)  # self CPU ms per profiled step
    part_ops: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # the same, inside each part


class Clock:
    """Accumulates the wall time of wrapped calls into the current step's parts (``wrap``) and of named pieces
    inside them (``wrap_inner``: reported beside the parts, not subtracted from ``loop``)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.inner: dict[str, float] = {}
        self.last_inner: dict[str, float] = {}
        self.mark = time.perf_counter()

    def wrap_inner(self, name: Callable[..., str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                key = name(*a, **kw) if callable(name) else name
                self.inner[key] = self.inner.get(key, 0.0) + (time.perf_counter() - t) * 1e3
        return timed

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                with torch.profiler.record_function(f"part:{part}"):
                    return fn(*a, **kw)
            finally:
                self.current[part] = self.current.get(part, 0.0) + (time.perf_counter() - t) * 1e3
        return timed

    def close(self) -> dict[str, float]:
        now = time.perf_counter()
        step = {part: self.current.get(part, 0.0) for part in PARTS if part != "loop"}
        step["total"] = (now - self.mark) * 1e3
        step["loop"] = step["total"] - sum(v for k, v in step.items() if k != "total")
        self.current, self.mark, self.last_inner, self.inner = {}, now, self.inner, {}
        return step


class Profiled:
    """``torch.profiler`` over the last steps of a launch; the collectives' time and calls per step."""

    def __init__(self, steps: int) -> None:
        import torch

        self.steps = steps
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.started = 0.0

    def start(self) -> None:
        self.prof.start()
        self.started = time.perf_counter()

    def stop(self, rec: StepRecord) -> None:
        self.prof.stop()
        rec.profiled_step_ms = (time.perf_counter() - self.started) * 1e3 / self.steps
        events = self.prof.key_averages()
        for e in events:
            name = e.key
            if name.startswith(("c10d::", "gloo:")) or "wait" in name.lower():
                rec.comm_ms[name] = e.cpu_time_total / 1e3 / self.steps
                rec.comm_calls[name] = e.count / self.steps
        by_part: dict[str, dict[str, float]] = {}
        for e in self.prof.events():
            part, up = None, e.cpu_parent
            while up is not None:
                if up.name.startswith("part:"):
                    part = up.name[5:]
                up = up.cpu_parent
            if part is not None:
                ops = by_part.setdefault(part, {})
                ops[e.name] = ops.get(e.name, 0.0) + e.self_cpu_time_total / 1e3 / self.steps
        rec.part_ops = {part: sorted(ops.items(), key=lambda kv: -kv[1])[:12] for part, ops in by_part.items()}
        rec.top_ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / self.steps) for e in events),
                             key=lambda kv: -kv[1])[:15]


def _run_native(args: argparse.Namespace, rec: StepRecord, world: int) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=native_peer._native_config(world, 0),
                                                 dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=native_peer.LR, weight_decay=0.0)
    data = native_peer.Tokens(args.data)
    loader = DataLoader(data, batch_size=args.micro, sampler=native_peer._sampler(data, world, rec.rank),
                        drop_last=True)
    clock, prof = Clock(), Profiled(args.profiled)
    forward = clock.wrap("forward", lambda b: model(input_ids=b["input_ids"], labels=b["labels"], use_cache=False))
    backward = clock.wrap("backward", lambda loss: loss.backward())
    step_fn = clock.wrap("optimizer", opt.step)
    zero = clock.wrap("zero_grad", lambda: opt.zero_grad(set_to_none=True))
    timed_end = args.warmup + args.steps
    for step, batch in enumerate(loader, start=1):
        loss = forward(batch).loss
        backward(loss)
        step_fn()
        zero()
        rec.losses.append(float(loss.detach()))
        _after_step(args, rec, clock, prof, step, timed_end)


def _after_step(args: argparse.Namespace, rec: StepRecord, clock: Clock, prof: Profiled, step: int,
                timed_end: int) -> None:
    parts = clock.close()
    if args.warmup < step <= timed_end:
        rec.steps_ms.append(parts)
        rec.inner_ms.append(clock.last_inner)
    if step == timed_end:
        prof.start()
    elif step == timed_end + args.profiled:
        prof.stop(rec)


def _run_zeromoe(args: argparse.Namespace, rec: StepRecord, world: int) -> None:
    """``native_peer.py``'s LightningModule (the same model, data, loss and optimizer), its hooks timing the
    step instead of counting memory."""
    import lightning as L
    from typing_extensions import override

    from lightning_zeromoe import ZeroMoEStrategy

    given = json.loads(args.variant_kwargs or "{}")
    kwargs = {k: v for k, v in given.items() if not k.startswith("_")}
    skip_one_rank = bool(given.get("_skip_one_rank_reduce_scatter"))
    strategy = ZeroMoEStrategy(ep_size=world, **kwargs)
    clock, prof = Clock(), Profiled(args.profiled)
    timed_end = args.warmup + args.steps
    peer = native_peer.Record(side=rec.side, model="mixtral", rank=rec.rank, world=world, losses=rec.losses)

    class Module(type(native_peer._lightning_module(args, peer, native=False))):  # type: ignore[misc]
        @override
        def on_train_start(self) -> None:
            engine = self.trainer.strategy.model
            engine.forward = clock.wrap("forward", engine.forward)
            engine.backward = clock.wrap("backward", engine.backward)
            engine.step = clock.wrap("optimizer", engine.step)
            pitfalls = self.trainer.strategy.pitfalls
            pitfalls.after_step = clock.wrap("strategy", pitfalls.after_step)
            _time_deepspeed_pieces(clock, engine, skip_one_rank)
            clock.close()

        @override
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            _after_step(args, rec, clock, prof, self.trainer.global_step, timed_end)

    kw = native_peer._trainer_kwargs(args, world)
    kw["max_steps"] = timed_end + args.profiled
    L.Trainer(strategy=strategy, **kw).fit(Module())


#: Methods of DeepSpeed's ZeRO-3 optimizer that make up ``DeepSpeedEngine.step`` (deepspeed/runtime/zero/stage3.py).
ZERO3_STEP_PIECES = ("_overflow_check_and_loss_scale_update", "_get_norm_groups", "zero_grad", "_prepare_sub_group",
                     "unscale_and_clip_grads", "_optimizer_step", "_reassign_or_swap_out_partitioned_parameters",
                     "_post_step")


def _time_deepspeed_pieces(clock: Clock, engine: Any, skip_one_rank: bool = False) -> None:
    """Time the ZeRO-3 step's pieces and the gradient reduce-scatter (``reduce_scatter_coalesced``, as stage3.py
    imported it) by the size of its group; ``skip_one_rank``: see ``_skip_one_rank_reduce_scatter``."""
    import torch.distributed as dist
    from deepspeed.runtime.zero import stage3

    opt = engine.optimizer
    for name in ZERO3_STEP_PIECES:
        if hasattr(opt, name):
            setattr(opt, name, clock.wrap_inner(f"step: {name}", getattr(opt, name)))
    original = stage3.reduce_scatter_coalesced
    if skip_one_rank:
        full = original

        def original(tensors: list[Any], group: Any = None) -> list[Any]:
            return [t.view(-1) for t in tensors] if dist.get_world_size(group) == 1 else full(tensors, group)
    stage3.reduce_scatter_coalesced = clock.wrap_inner(
        lambda tensors, group=None: f"backward: reduce_scatter_coalesced, group of {dist.get_world_size(group)}",
        original)


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rec = StepRecord(side=args.worker_side, rank=rank)
    (_run_native if args.worker == "native" else _run_zeromoe)(args, rec, world)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(asdict(rec)))
    return 0


# ------------------------------------------------------------------ driver


def launch(side: str, kwargs: str, base: Path, out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    world = args.ranks
    own = json.loads(kwargs or "{}")
    native = side == "native" or own.get("_side") == "native"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(native_peer._free_port()), str(Path(__file__).resolve()),
           "--worker", "native" if native else "zeromoe", "--worker-side", side,
           "--variant-kwargs", kwargs, "--model", str(base / "mixtral"), "--data", str(base / "tokens.pt"),
           "--out", str(out), "--micro", str(args.global_batch // world), "--seq", str(args.seq),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--profiled", str(args.profiled)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **own.get("_env", {}))
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    print(f"  {side:>24}: {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(res: dict[str, Any]) -> str:
    """The tables: per side, the step split (median over the launches of each launch's median step, rank 0),
    the collectives per profiled step, the paired ratios, parity."""
    sides = list(res["sides"])
    out: list[str] = []
    split: dict[str, dict[str, float]] = {}
    for side in sides:
        launches = [r[0] for r in res["runs"][side]]
        split[side] = {part: _med([_med([s[part] for s in rec["steps_ms"]]) for rec in launches])
                       for part in ("total", *PARTS)}
    out += ["### Step split, ms per optimizer step (rank 0; median over launches of each launch's median step)", "",
            "| part | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
    for part in ("total", *PARTS):
        out.append(f"| {part} | " + " | ".join(f"{split[s][part]:.1f}" for s in sides) + " |")
    pieces = {s: [r[0]["inner_ms"] for r in res["runs"][s] if any(r[0].get("inner_ms", []))] for s in sides}
    inner = sorted({k for s in sides for steps in pieces[s] for st in steps for k in st})
    if inner:
        out += ["", "### Pieces inside the parts, ms per step (rank 0; median as above; launches: "
                + ", ".join(f"{s} {len(pieces[s])}" for s in sides if pieces[s]) + ")", "",
                "| piece | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
        for k in inner:
            out.append(f"| {k} | " + " | ".join(
                f"{_med([_med([st.get(k, 0.0) for st in steps]) for steps in pieces[s]]):.1f}" if pieces[s] else "-"
                for s in sides) + " |")
    out += ["", "### Collectives per profiled step, rank 0 (torch.profiler CPU time, ms; calls)", ""]
    names = sorted({n for s in sides for r in res["runs"][s] for n in r[0]["comm_ms"]})
    out += ["| event | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
    for n in names:
        cells = []
        for s in sides:
            ms = _med([r[0]["comm_ms"].get(n, 0.0) for r in res["runs"][s]])
            calls = _med([r[0]["comm_calls"].get(n, 0.0) for r in res["runs"][s]])
            cells.append(f"{ms:.1f} ({calls:g})" if calls else "-")
        out.append(f"| `{n}` | " + " | ".join(cells) + " |")
    out.append("| profiled step, ms | " + " | ".join(
        f"{_med([r[0]['profiled_step_ms'] for r in res['runs'][s]]):.1f}" for s in sides) + " |")
    base = "zeromoe"
    out += ["", f"### Step time ratios, paired by repeat (side / native; {base}-relative in the last column)", "",
            "| side | repeats | total / native, median (range) | side / zeromoe, median (range) |",
            "|---|---:|---|---|"]
    for s in sides:
        if s == "native":
            continue
        tot = {x: [_med([st["total"] for st in r[0]["steps_ms"]]) for r in res["runs"][x]] for x in (s, "native", base)}
        vs_n = [a / b for a, b in zip(tot[s], tot["native"])]
        vs_z = [a / b for a, b in zip(tot[s], tot[base])]
        out.append(f"| {s} | {len(vs_n)} | {_med(vs_n):.3f} ({min(vs_n):.3f}-{max(vs_n):.3f}) | "
                   f"{_med(vs_z):.3f} ({min(vs_z):.3f}-{max(vs_z):.3f}) |")
    out += ["", "### Top operators by self CPU time per profiled step, rank 0, first launch (ms)", ""]
    for s in sides:
        ops = ", ".join(f"`{n}` {ms:.1f}" for n, ms in res["runs"][s][0][0]["top_ops"][:10])
        out.append(f"- {s}: {ops}")
    out += ["", "### Inside each part: top operators by self CPU time per profiled step, rank 0, first launch (ms)",
            ""]
    for s in sides:
        for part, ops in res["runs"][s][0][0]["part_ops"].items():
            out.append(f"- {s} / {part}: " + ", ".join(f"`{n}` {ms:.1f}" for n, ms in ops[:10]))
    out += ["", "### Parity with the plain single-process run (max abs diff of the per-step loss, every launch)", ""]
    same = [[rank["losses"] for rank in ranks] for ranks in res["runs"].get("zeromoe", [])[:1]]
    for s in sides:
        equal = all([rank["losses"] for rank in ranks] == same[0] for ranks in res["runs"][s]) if same else False
        identical = "" if s == "zeromoe" or not same else \
            f"; every rank's losses identical to zeromoe's, bit for bit: {'yes' if equal else 'no'}"
        out.append(f"- {s}: {max(res['parity'][s]):.2e} (tolerance {res['args']['tolerance']:g}){identical}")
    return "\n".join(out)


GLIBC_NO_MMAP = "glibc.malloc.mmap_max=0"


def adamw_term(args: argparse.Namespace) -> dict[str, list[float]]:
    """ms per ``AdamW.step`` by layout, each round's median step (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    layers, local, hidden, inter = 4, 4, args.hidden, args.intermediate
    shapes = [(local, 2 * inter, hidden), (local, hidden, inter)] * layers
    total = sum(a * b * c for a, b, c in shapes)
    piece = args.adamw_piece
    layouts = {"per-layer tensors": [torch.zeros(s) for s in shapes], "one flat tensor": [torch.zeros(total)],
               f"flat pieces of {piece:g}": [torch.zeros(min(piece, total - i)) for i in range(0, total, piece)]}
    opts = {}
    for name, params in layouts.items():
        params = [torch.nn.Parameter(t) for t in params]
        for p in params:
            p.grad = torch.randn_like(p)
        opts[name] = torch.optim.AdamW(params, lr=native_peer.LR, weight_decay=0.0)
    out: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, opt in opts.items():
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                opt.step()
                times.append((time.perf_counter() - t) * 1e3)
            out[name].append(statistics.median(times))
    return out


def adamw_report(args: argparse.Namespace) -> str:
    env = dict(os.environ, GLIBC_TUNABLES=GLIBC_NO_MMAP)
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--adamw", "--adamw-child",
                            "--repeats", str(args.repeats), "--steps", str(args.steps), "--adamw-piece",
                            str(args.adamw_piece), "--hidden", str(args.hidden), "--intermediate",
                            str(args.intermediate)], env=env, capture_output=True, text=True, timeout=args.timeout)
    if child.returncode:
        raise SystemExit(child.stderr[-3000:])
    here, no_mmap = adamw_term(args), json.loads(child.stdout.strip().splitlines()[-1])
    lines = [f"### AdamW.step over one rank's expert parameters, ms (median of {args.repeats} rounds' median of "
             f"{args.steps} steps; range), and / per-layer tensors paired by round", "",
             "| layout | glibc default | ratio | mmap_max=0 | ratio |", "|---|---:|---:|---:|---:|"]
    first = next(iter(here))
    for name in here:
        cells = []
        for v, base in ((here[name], here[first]), (no_mmap[name], no_mmap[first])):
            ratio = [a / b for a, b in zip(v, base)]
            cells += [f"{_med(v):.1f} ({min(v):.1f}-{max(v):.1f})",
                      f"{_med(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (perf_counter)")
    parser.add_argument("--profiled", type=int, default=3, help="steps under torch.profiler after the timed ones")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="a zeromoe side with these ZeroMoEStrategy keyword arguments")
    parser.add_argument("--no-native", action="store_true", help="only the zeromoe sides")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--adamw", action="store_true", help="only the AdamW layout term, in this process")
    parser.add_argument("--adamw-piece", type=int, default=5_000_000, help="elements per flat piece (--adamw)")
    parser.add_argument("--adamw-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", type=Path, help="reprint the tables of an earlier --json")
    parser.add_argument("--worker", choices=("native", "zeromoe"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-side", help=argparse.SUPPRESS)
    parser.add_argument("--variant-kwargs", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.adamw_child:
        print(json.dumps(adamw_term(args)))
        return 0
    if args.adamw:
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {native_peer._machine()}\n"
              f"{' '.join([Path(sys.executable).name, *sys.argv])}\n")
        print(adamw_report(args))
        return 0
    if args.table:
        res = json.loads(args.table.read_text())
        print(res["header"])
        print(summarize(res))
        return 0
    sides = {} if args.no_native else {"native": ""}
    sides["zeromoe"] = ""
    for v in args.variant:
        name, _, kw = v.partition("=")
        json.loads(kw)
        sides[name] = kw
    import torch

    torch.set_num_threads(1)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {native_peer._machine()}\n"
              f"{' '.join([Path(sys.executable).name, *sys.argv])}\n{args.ranks} ranks, Mixtral-style model "
              f"hidden {args.hidden}, global batch {args.global_batch} x {args.seq} tokens, {args.warmup} warm-up + "
              f"{args.steps} timed + {args.profiled} profiled steps, {args.repeats} repeats")
    res: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "sides": sides, "runs": {s: [] for s in sides}, "parity": {s: [] for s in sides}}
    total_steps = args.warmup + args.steps + args.profiled
    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        base = Path(tmp)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 1024, (args.global_batch * total_steps, args.seq), generator=gen)
        torch.save(tokens, base / "tokens.pt")
        native_peer.build_model("mixtral", args.hidden, args.intermediate).save_pretrained(base / "mixtral")
        ref_args = argparse.Namespace(warmup=args.warmup + args.profiled, steps=args.steps,
                                      global_batch=args.global_batch)
        ref = native_peer.reference_losses("mixtral", base, ref_args)
        names = list(sides)
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
            for side in order:
                ranks = launch(side, sides[side], base, base / f"{side}-{repeat}", args)
                res["runs"][side].append(ranks)
                run = {"ranks": ranks}
                res["parity"][side].append(native_peer.parity(run, ref))
    res["header"] = header + f"; load average {load} at the start, " + \
        "/".join(f"{x:.1f}" for x in os.getloadavg()) + " at the end"
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(res["header"])
    print(summarize(res))
    bad = [s for s in sides if max(res["parity"][s]) > args.tolerance]
    if bad:
        print(f"\nPARITY FAILED (over --tolerance {args.tolerance:g}): {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
