"""What torch's Flight Recorder costs per step, on vs off, side by side.

Two CPU ranks (gloo) run a step made of the collectives a ZeRO-3 + expert-parallel step of the tiny
MoE issues (per step, from a real dump of ``tests/jobs/hang_job.py``: about 25 parameter all-gathers,
13 expert all-to-alls, a few all-reduces and broadcasts), with small tensors, so that the
collectives' own cost is small and the recorder's share shows. Each repeat is a fresh pair of
processes, alternately with ``TORCH_FR_BUFFER_SIZE=2000`` (what ``ZeroMoEStrategy`` sets) and without
it; each reports, over ``--steps`` steps, the median wall time of a step and the median CPU time of
the thread that issues the collectives (where the recorder does its work: it copies the sizes and
captures the Python stack; on a busy machine the wall time mostly measures waiting for the peer).
Printed: per repeat the medians, then the median over repeats, on/off ratios and cost per collective.

    python benchmarks/flight_recorder_cost.py --repeats 7 --steps 60

Each run reports how many entries rank 0's recorder holds at the end, as proof that "off" recorded
nothing (torch 2.13, gloo: unset records 2000, ``0`` records none). First it prints what the strategy
adds on top of torch's recorder: the gather log (:func:`gather_log_cost`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: One step's collectives: (op, numel); sizes like the tiny MoE's partitions and token exchanges.
STEP = ([("all_gather", 4096)] * 25 + [("all_to_all", 2048)] * 13 + [("all_reduce", 1)] * 4
        + [("broadcast", 1)] * 2)


def _rank(rank: int, port: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = {numel: torch.ones(numel) for _, numel in STEP}
    outputs = {numel: torch.empty(2 * numel) for _, numel in STEP}
    times, cpu = [], []
    for _ in range(steps + 5):
        t0, c0 = time.perf_counter(), time.thread_time()
        for op, numel in STEP:
            if op == "all_gather":
                dist.all_gather_into_tensor(outputs[numel], tensors[numel])
            elif op == "all_to_all":
                dist.all_to_all_single(outputs[numel][:numel], tensors[numel])
            elif op == "all_reduce":
                dist.all_reduce(tensors[numel])
            else:
                dist.broadcast(tensors[numel], 0)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    if rank == 0:
        import pickle

        from lightning_zeromoe._private.torch import dump_flight_recorder

        recorded = len(pickle.loads(dump_flight_recorder())["entries"])  # proof the recorder was on (or off)
        print(json.dumps({"median_step_s": statistics.median(times[5:]), "median_cpu_s": statistics.median(cpu[5:]),
                          "recorded": recorded}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _pair(port: int, steps: int, recorder: bool) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    env["TORCH_FR_BUFFER_SIZE"] = "2000" if recorder else "0"
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--steps", str(steps)],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(out[0].strip().splitlines()[-1])


def gather_log_cost(repeats: int, steps: int) -> None:
    """What ``ZeroMoEStrategy(flight_recorder=True)`` adds per step besides torch's recorder: the
    :class:`~lightning_zeromoe.engine.flight_recorder.GatherLog` forward pre-hook on every module that
    holds partitioned parameters. Timed on the tiny MoE LM's forward + backward in one process, with the
    hook on every module that holds parameters (under ZeRO-3: those whose parameters are partitioned),
    alternating with and without."""
    import torch

    from lightning_zeromoe.engine.flight_recorder import GatherLog
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyMoELM(TinyMoEConfig(num_experts=4))
    ids = torch.randint(0, model.config.vocab_size, (4, model.config.max_seq_len // 2))

    model(ids)[0].float().pow(2).mean().backward()  # warm-up (first calls initialise lazily)

    def step_times() -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(ids)[0].float().pow(2).mean().backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    log = GatherLog()
    with_hooks, without = [], []
    for repeat in range(repeats):
        for hooked in ((True, False) if repeat % 2 == 0 else (False, True)):
            if hooked:
                hooks = log.attach(model, partitioned_only=False)
            (with_hooks if hooked else without).append(step_times())
            log.detach()
    m_on, m_off = statistics.median(with_hooks), statistics.median(without)
    print(f"gather log: {hooks} hooked modules; median step (forward + backward of the tiny MoE LM) with "
          f"{m_on * 1e3:.2f} ms, without {m_off * 1e3:.2f} ms, ratio {m_on / m_off:.3f} "
          f"({repeats} alternating repeats of {steps} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args()
    if args.rank is not None:
        return _rank(args.rank, args.port, args.steps)
    gather_log_cost(args.repeats, args.steps)
    on, off = [], []
    for repeat in range(args.repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)  # interleaved, alternating first
        for recorder in order:
            (on if recorder else off).append(_pair(args.port + 2 * repeat + recorder, args.steps, recorder))
        print(f"repeat {repeat + 1}: wall on {on[-1]['median_step_s'] * 1e3:.2f} ms off "
              f"{off[-1]['median_step_s'] * 1e3:.2f} ms; main-thread CPU on {on[-1]['median_cpu_s'] * 1e3:.2f} ms off "
              f"{off[-1]['median_cpu_s'] * 1e3:.2f} ms per step; entries recorded on "
              f"{on[-1].get('recorded')} off {off[-1].get('recorded')}", flush=True)
    print(f"{len(STEP)} collectives per step, {args.steps} steps per run, {args.repeats} repeats")
    if {r["recorded"] for r in off} & {r["recorded"] for r in on}:
        print(f"NOTE: with the recorder 'off' (TORCH_FR_BUFFER_SIZE=0) rank 0 still recorded {off[-1]['recorded']} "
              "entries: both columns below pay the recorder, and their ratio is noise, not its cost")
    for key, label in (("median_step_s", "wall time"), ("median_cpu_s", "main-thread CPU time")):
        m_on = statistics.median(r[key] for r in on)
        m_off = statistics.median(r[key] for r in off)
        print(f"median {label} per step: recorder on {m_on * 1e3:.2f} ms, off {m_off * 1e3:.2f} ms, ratio on/off "
              f"{m_on / m_off:.3f}; {(m_on - m_off) / len(STEP) * 1e6:+.1f} us per collective")


if __name__ == "__main__":
    main()
