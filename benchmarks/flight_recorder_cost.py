"""What torch's Flight Recorder costs per step, on vs off, side by side.

Two CPU ranks (gloo) run a step made of the collectives a ZeRO-3 + expert-parallel step of the tiny
MoE issues (per step, from a real dump of ``tests/jobs/hang_job.py``: about 25 parameter all-gathers,
13 expert all-to-alls, a few all-reduces and broadcasts), with small tensors, so that the
collectives' own cost is small and the recorder's share shows. Each repeat is a fresh pair of
processes, alternately with ``TORCH_FR_BUFFER_SIZE=2000`` (what ``ZeroMoEStrategy`` sets) and without
it; each reports the median step time over ``--steps`` steps. Printed: per repeat the two medians,
then the median over repeats of each and their ratio, and the cost per collective.

    python benchmarks/flight_recorder_cost.py --repeats 7 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: One step's collectives: (op, numel); sizes like the tiny MoE's partitions and token exchanges.
STEP = ([("all_gather", 4096)] * 25 + [("all_to_all", 2048)] * 13 + [("all_reduce", 1)] * 4
        + [("broadcast", 1)] * 2)


def _rank(rank: int, port: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = {numel: torch.ones(numel) for _, numel in STEP}
    outputs = {numel: torch.empty(2 * numel) for _, numel in STEP}
    times = []
    for _ in range(steps + 5):
        t0 = time.perf_counter()
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
    if rank == 0:
        print(json.dumps({"median_step_s": statistics.median(times[5:])}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _pair(port: int, steps: int, recorder: bool) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    if recorder:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--steps", str(steps)],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(out[0].strip().splitlines()[-1])["median_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args()
    if args.rank is not None:
        return _rank(args.rank, args.port, args.steps)
    on, off = [], []
    for repeat in range(args.repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)  # interleaved, alternating first
        for recorder in order:
            (on if recorder else off).append(_pair(args.port + 2 * repeat + recorder, args.steps, recorder))
        print(f"repeat {repeat + 1}: on {on[-1] * 1e3:.2f} ms  off {off[-1] * 1e3:.2f} ms per step", flush=True)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"{len(STEP)} collectives per step, {args.steps} steps per run, {args.repeats} repeats")
    print(f"median step: recorder on {m_on * 1e3:.2f} ms, off {m_off * 1e3:.2f} ms, ratio on/off {m_on / m_off:.3f}; "
          f"{(m_on - m_off) / len(STEP) * 1e6:.1f} us per collective")


if __name__ == "__main__":
    main()
