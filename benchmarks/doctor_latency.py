"""How long ``troubleshooter doctor`` and ``explain`` take, next to ``ds_report``.

Why: the doctor is what people run first when training will not start, and it must not be slower
than the tool they already know. Targets (issues 4 and 10): ``doctor --json`` and ``doctor
--report`` no slower than ``ds_report`` while checking strictly more; ``explain`` on a 1 MB log
under 1 s (a fresh process, interpreter start-up included).

Method: every command runs as a fresh process ("cold": a new interpreter that imports everything
it needs; the OS file cache is warm for all of them alike), the commands are interleaved in a
rotating order so that background load hits all of them equally, and each is repeated
``--repeats`` times. The table shows medians, min and max, and each median's ratio to
``ds_report``'s. Run from the repository root:

    .venv/bin/python benchmarks/doctor_latency.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRACEBACK = """\
[rank1]:[E1129 10:52:01.123456 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective \
operation timeout: WorkNCCL(SeqNum=4242, OpType=ALLTOALL_BASE, NumelIn=1048576, \
NumelOut=1048576, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.
Traceback (most recent call last):
  File "train.py", line 88, in <module>
    trainer.fit(model)
RuntimeError: NCCL communicator was aborted on rank 1.
"""


def make_log(path: Path, size: int) -> None:
    """A training log of ``size`` bytes: progress lines, warnings, then the real error at the end."""
    rng = random.Random(0)
    lines, total = [], 0
    step = 0
    while total < size - len(TRACEBACK):
        step += 1
        line = (f"Epoch 0:  {step % 100:3d}%|####      | {step}/100000 [00:{step % 60:02d}<03:12, "
                f"{rng.uniform(1, 9):.2f}it/s, loss={rng.uniform(1, 4):.4f}, aux_loss="
                f"{rng.uniform(0, .05):.5f}, tokens_per_expert=[{', '.join(str(rng.randint(0, 999)) for _ in range(8))}]]\n")
        if step % 500 == 0:
            line = (f"[WARNING] [stage3.py:{step % 2000}:_post_step] {step} pytorch allocator cache "
                    "flushes since last step. this happens when there is high memory pressure\n")
        lines.append(line)
        total += len(line)
    path.write_text("".join(lines) + TRACEBACK)


Sample = tuple[float, float, int]  # wall seconds, CPU seconds (user + sys), exit status


def cpu_of_children() -> float:
    """User + system CPU seconds of all finished child processes so far (grandchildren included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_once(argv: list[str]) -> Sample:
    """Wall and CPU seconds and exit status of one fresh run (output discarded).

    CPU time is reported too because it does not grow when other jobs share the machine.
    """
    cpu, start = cpu_of_children(), time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                          env={**os.environ, "NO_COLOR": "1"})
    return time.perf_counter() - start, cpu_of_children() - cpu, proc.returncode


def commands(log: Path) -> dict[str, list[str]]:
    """The commands compared; ds_report is run by this interpreter, like the doctor."""
    ds_report = Path(sys.executable).with_name("ds_report")
    return {
        "doctor --json": [sys.executable, "-m", "troubleshooter", "doctor", "--json"],
        "doctor --report": [sys.executable, "-m", "troubleshooter", "doctor", "--report"],
        "ds_report": [sys.executable, str(ds_report)],
        "explain (1 MB log)": [sys.executable, "-m", "troubleshooter", "explain", str(log)],
    }


def run(repeats: int, log_size: int) -> dict[str, list[Sample]]:
    """Interleaved timings: in each round every command runs once, in a rotated order."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "train.log"
        make_log(log, log_size)
        cmds = commands(log)
        names = list(cmds)
        samples: dict[str, list[Sample]] = {n: [] for n in names}
        for round_no in range(repeats):
            order = names[round_no % len(names):] + names[:round_no % len(names)]
            for name in order:
                samples[name].append(time_once(cmds[name]))
                print(f"  round {round_no + 1}/{repeats} {name:<20} {samples[name][-1][0]:6.2f} s wall",
                      file=sys.stderr)
            samples.setdefault("explain in-process", []).append(explain_in_process(log))
    return samples


def explain_in_process(log: Path) -> Sample:
    """explain's own work on the log (read, clean, match), without interpreter start-up."""
    from troubleshooter import explain

    explain.explain_text("warm-up")  # the knowledge base is loaded once per process, as in the CLI
    cpu, start = time.process_time(), time.perf_counter()
    found = explain.explain_input(explain.read_input(log))
    return time.perf_counter() - start, time.process_time() - cpu, 0 if found else 1


def table(samples: dict[str, list[Sample]]) -> str:
    """Wall median/min/max, CPU median, and both medians' ratios to ds_report's."""
    base_wall = statistics.median(s[0] for s in samples["ds_report"])
    base_cpu = statistics.median(s[1] for s in samples["ds_report"])
    rows = [f"{'command':<20} {'runs':>4} {'wall median':>11} {'min':>6} {'max':>6} {'wall ratio':>10} "
            f"{'CPU median':>10} {'CPU ratio':>9}  exit codes"]
    for name, runs in samples.items():
        wall = [s[0] for s in runs]
        cpu = statistics.median(s[1] for s in runs)
        codes = sorted({s[2] for s in runs})
        rows.append(f"{name:<20} {len(runs):>4} {statistics.median(wall):10.2f}s {min(wall):6.2f} "
                    f"{max(wall):6.2f} {statistics.median(wall) / base_wall:9.2f}x {cpu:9.2f}s "
                    f"{cpu / base_cpu:8.2f}x  {codes}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--log-size", type=int, default=2**20, help="bytes of log for explain (1 MiB)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} before the run",
          file=sys.stderr)
    samples = run(args.repeats, args.log_size)
    print(table(samples))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
