"""Peak memory per rank during the first and a steady training step: measured against the planner.

Real ``Trainer(strategy=ZeroMoEStrategy(...))`` runs (fp32, CPU, gloo) of a Mixtral-like tiny MoE
whose experts are 90% of its 14 M parameters (8 experts x 3 x 256 x 512 per layer, 4 layers),
with the strategy's own bucket and threshold settings, on 2 and 4 ranks, for four cases:
ZeRO-3 with the MoE blocks as leaf modules (``ep_size=1``), ZeRO-3 + EP, ZeRO-2 + EP, ZeRO-1 + EP.
Each rank measures its resident set's high-water mark during step 0 (the first) and step 4 (steady:
after the strategy's gradient audit), over a baseline taken before the engine is built
(``tests/jobs/peak_memory_job.py`` says exactly how, and why glibc's mmap threshold is fixed), and
the planner (``lightning_zeromoe.planner.working_set``) predicts the same figures from DeepSpeed's
rules. Prints one row per case and rank set, then the planner's per-term breakdown.

    python benchmarks/peak_memory.py                    # worlds 2 and 4: 3 min 30 s on 2 idle cores
    python benchmarks/peak_memory.py --worlds 2 --cases 3:1,1:2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from jobs.peak_memory_job import predict  # noqa: E402

CASES = "3:1,3:2,2:2,1:2"


def measure(world: int, cases: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, str(REPO / "tests/jobs/peak_memory_job.py"), "--out", out,
                               "--world", str(world), "--cases", cases], capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"world {world} failed:\n{proc.stderr[-4000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--breakdown", action="store_true", help="print every case's per-term table")
    args = parser.parse_args()
    mib = 2**20
    rows = ["| world | case | leaf blocks | held before step 0, meas. / pred. | first step peak, meas. / pred. (ratio) "
            "| where, meas. / pred. | steady step peak, meas. / pred. (ratio) | where, meas. / pred. |",
            "|---|---|---:|---|---|---|---|---|"]
    tables = []
    for world in (int(w) for w in args.worlds.split(",")):
        ranks = measure(world, args.cases)
        for index, pair in enumerate(args.cases.split(",")):
            stage, ep = (int(x) for x in pair.split(":"))
            est = predict(stage, ep, world)
            runs = [r["runs"][index] for r in ranks]
            held_pred = sum(t.resident for t in est.first.held)
            first = max(r["peak_0"] for r in runs)
            steady = max(r["peak_4"] for r in runs)
            held = max(r["held_0"] for r in runs)
            def where(step: int) -> str:
                return max(("forward", "backward", "step"), key=lambda k: runs[0][f"{k}_{step}"])

            rows.append(f"| {world} | ZeRO-{stage}, ep_size={ep} | {len(runs[0]['leaf_modules'])} "
                        f"| {held / mib:.1f} / {held_pred / mib:.1f} MiB "
                        f"| {first / mib:.1f} / {est.first.resident / mib:.1f} MiB ({first / est.first.resident:.3f}) "
                        f"| {where(0)} / {est.first.where} "
                        f"| {steady / mib:.1f} / {est.steady.resident / mib:.1f} MiB "
                        f"({steady / est.steady.resident:.3f}) | {where(4)} / {est.steady.where} |")
            tables.append(f"world {world}, ZeRO-{stage} ep_size={ep}: per rank measured first "
                          f"{[round(r['peak_0'] / mib, 1) for r in runs]} steady {[round(r['peak_4'] / mib, 1) for r in runs]} MiB\n"
                          + est.table())
    print("\n".join(rows))
    if args.breakdown:
        print("\n\n".join(tables))


if __name__ == "__main__":
    main()
