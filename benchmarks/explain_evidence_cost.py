"""What normalising a report and deciding on evidence (issue 36) cost ``explain``, side by side.

Runs ``explain`` in-process (reading and deciding, no interpreter start-up) on the 1 MiB log of
``doctor_latency.py``, alternately with this checkout and with another one (``--base``: an export
of the commit before the change, e.g. ``git archive b4a6fe0 troubleshooter lightning_zeromoe |
tar -x -C /tmp/base``), each run in a fresh process, and prints the medians and their ratio.

    .venv/bin/python benchmarks/explain_evidence_cost.py --base /tmp/base --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctor_latency  # noqa: E402  (the same log as the latency benchmark)

REPO = Path(__file__).resolve().parents[1]
_CODE = ("import sys, time\nfrom pathlib import Path\nfrom troubleshooter import explain\n"
         "explain.explain_text('warm-up')\n"
         "cpu, wall = time.process_time(), time.perf_counter()\n"
         "found = explain.explain_input(explain.read_input(Path(sys.argv[1])))\n"
         "print(time.perf_counter() - wall, time.process_time() - cpu, found[0].entry_id if found else None)\n")


def once(root: Path, log: Path) -> tuple[float, float, str]:
    """Wall and CPU seconds of explain on ``log`` with the packages of ``root``, and its answer."""
    out = subprocess.run([sys.executable, "-c", _CODE, str(log)], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(root)}, cwd=tempfile.gettempdir()).stdout.split()
    return float(out[0]), float(out[1]), out[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a tree with the old troubleshooter")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trees = {"before": args.base, "after": REPO}
    runs: dict[str, list[tuple[float, float, str]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "train.log"
        doctor_latency.make_log(log, 2**20)
        for r in range(args.repeats):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):  # alternate the order
                runs[name].append(once(trees[name], log))
    for name, samples in runs.items():
        walls = ", ".join(f"{s[0]:.2f}" for s in samples)
        print(f"{name:<7} wall median {statistics.median(s[0] for s in samples):.3f} s ({walls}); "
              f"CPU median {statistics.median(s[1] for s in samples):.3f} s; answer {sorted({s[2] for s in samples})}")
    for i, what in ((0, "wall"), (1, "CPU")):
        ratio = statistics.median(s[i] for s in runs["after"]) / statistics.median(s[i] for s in runs["before"])
        print(f"after / before, {what}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
