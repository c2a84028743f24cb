"""The communication model against the ledger: bytes per optimizer step by collective and group.

For each world size, one ``torch.distributed.run`` launch of ``tests/jobs/comm_ledger_job.py``
trains the listed setups on raw DeepSpeed engines with the config ``ZeroMoEStrategy`` builds and
``CommLedger`` installed (3 optimizer steps each, the tiny MoE of the job: hidden 64, 2 MoE layers
of 4 experts top-2, 4 x 32 tokens per micro-batch), and ``lightning_zeromoe.planner.comm``
predicts the same step from the model's parameter sizes and the config. Prints the table of docs/concepts/models.md:
the ledger's bytes of the last step (averaged over ranks), the prediction, their ratio, and the
worst (collective, group) cell; then whether the ledger's call counts equal those the step-time
model charges latency for. Setup names: ``s<stage>e<ep_size>`` with optional ``a<accumulation>``,
``r<stage3_max_reuse_distance>``, ``p<stage3_prefetch_bucket_size>`` and a final ``b`` for bf16.
The 2-rank setups are what ``tests/test_comm_ledger.py`` asserts in CI (with one ``Trainer.fit``).

    python benchmarks/comm_ledger.py                       # 2 and 4 ranks, ~40 s on 2 idle cores
    python benchmarks/comm_ledger.py --worlds 4 --setups s1e4,s3e4
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.comm_records import compare, compare_calls, worst_cell  # noqa: E402
from support.jobs import free_port, read_ranks  # noqa: E402

#: Every stage x ep_size, accumulation at stages 1 and 3, a ZeRO-3 backward re-gather, bf16.
SETUPS = "s1e1,s2e1,s3e1,s1e2,s2e2,s3e2,s1e2a2,s3e2a2,s3e1r100000p0,s3e2b"
#: Added on 4 ranks: every rank its own expert-parallel slot.
FOUR_RANKS = "s1e4,s3e4"


def measure(world: int, setups: str, out: Path) -> dict[str, list[dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(REPO / "tests/jobs/comm_ledger_job.py"), "--out", str(out), "--raw", setups]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"world {world} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {name: read_ranks(out / f"raw_{name}", world) for name in setups.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--setups", default=None, help=f"default: {SETUPS} (+{FOUR_RANKS} on 4 ranks)")
    args = parser.parse_args()
    print("| ranks | setup | stage | ep | accum | measured MB/step | predicted MB/step | predicted / measured "
          "| worst cell |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    worst_overall, call_mismatches = 0.0, []
    for world in (int(w) for w in args.worlds.split(",")):
        setups = args.setups or (SETUPS + ("," + FOUR_RANKS if world >= 4 else ""))
        with tempfile.TemporaryDirectory() as out:
            runs = measure(world, setups, Path(out))
        for name, ranks in runs.items():
            measured, predicted = compare(ranks, -1)
            cell, error = worst_cell(measured, predicted)
            worst_overall = max(worst_overall, error)
            calls, predicted_calls = compare_calls(ranks, -1)
            if calls != predicted_calls:
                call_mismatches.append(f"{world} ranks {name}: ledger {calls}, model {predicted_calls}")
            got, want, r = sum(measured.values()), sum(predicted.values()), ranks[0]
            where = f" ({cell})" if error else ""
            print(f"| {world} | {name} (raw) | {r['stage']} | {r['ep_size']} | {r['accumulation']} | {got / 1e6:.4f} "
                  f"| {want / 1e6:.4f} | {want / got:.4f} | {error:.0e}{where} |", flush=True)
    print(f"\nworst cell over all runs: {worst_overall:.2e} relative (target: within 5%)")
    print("collective calls per cell (the step-time model's latency term): "
          + ("equal to the ledger's in every run" if not call_mismatches else "\n  ".join(["differ:", *call_mismatches])))


if __name__ == "__main__":
    main()
