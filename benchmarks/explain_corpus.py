"""How ``troubleshooter explain`` does on the real, blind-collected corpus of pasted reports.

The corpus lives in ``tests/fixtures/explain_corpus/``: texts pasted by users in public threads,
saved verbatim (as the search store holds them), each with its URL, what the thread concluded and
a label (a knowledge-base entry id, ``none`` when no entry's cause and fixes apply, or ``healthy``
for a log of a run that worked). ``manifest.json`` assigns every sample to the ``dev`` or the
``test`` half by a hash of its URL, fixed when the sample was saved; tune on ``dev`` only and
report on ``test``. ``holdout2`` was collected later (2026-12-05), after the matcher had been tuned on
``dev`` and ``test``, as a fresh held-out set; ``holdout3`` later still, blind, while the matcher was being
tuned on the first three; ``holdout4`` to ``holdout12`` the same way, each later still;
``all`` means every half.

Every sample is run the way users run explain: ``python -m troubleshooter explain FILE --json``
in a subprocess (the ``troubleshooter`` found on ``PYTHONPATH``, so run it from the worktree with
``PYTHONPATH=$PWD``). The first diagnosis counts:

- known problems (label = an entry id): recalled when the first diagnosis is that entry;
- unknown problems (label ``none``): a wrong claim when explain names any entry;
- healthy logs (label ``healthy``): flagged when explain names any entry.

    python benchmarks/explain_corpus.py --half dev            # per-sample table and the summary
    python benchmarks/explain_corpus.py --half test --json    # machine-readable
    python benchmarks/explain_corpus.py --half holdout2       # the later, fresh held-out set
    python benchmarks/explain_corpus.py --half holdout3       # the third blind held-out set
    python benchmarks/explain_corpus.py --half holdout4       # the fourth blind held-out set
    python benchmarks/explain_corpus.py --half holdout5       # the fifth blind held-out set
    python benchmarks/explain_corpus.py --half holdout6       # the sixth blind held-out set
    python benchmarks/explain_corpus.py --half holdout7       # the seventh blind held-out set
    python benchmarks/explain_corpus.py --half holdout8       # the eighth blind held-out set
    python benchmarks/explain_corpus.py --half holdout9       # the ninth blind held-out set
    python benchmarks/explain_corpus.py --half holdout10      # the tenth blind held-out set
    python benchmarks/explain_corpus.py --half holdout11      # the eleventh blind held-out set
    python benchmarks/explain_corpus.py --half holdout12      # the twelfth blind held-out set
    python benchmarks/explain_corpus.py --half all --jobs 2

``--with-title`` puts the thread's title (recorded from ``holdout6`` on) on the line above the text, as a
bug report carries it: it separates what the matcher missed from what the paste never held (a sample
without a recorded title runs as it is).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "explain_corpus"
MANIFEST = CORPUS / "manifest.json"
KINDS = ("known", "unknown", "healthy")
HALVES = ("dev", "test", "holdout2", "holdout3", "holdout4", "holdout5", "holdout6", "holdout7", "holdout8",
          "holdout9", "holdout10", "holdout11", "holdout12")
# holdout2: collected after dev and test had been tuned on; holdout3: collected blind while the matcher was
# being tuned on dev, test and holdout2; holdout4 to holdout12: collected blind the same way, each later still


@dataclass(frozen=True)
class Sample:
    """One manifest record: a saved paste and what it should be diagnosed as."""

    file: str
    half: str
    url: str
    label: str
    kind: str
    title: str = ""


@dataclass(frozen=True)
class Outcome:
    """What explain said about one sample, and whether that counts as right."""

    file: str
    url: str
    kind: str
    label: str
    first: str | None
    ids: tuple[str, ...]
    correct: bool
    error: str


@dataclass(frozen=True)
class Summary:
    """The three rates of the issue, for one half."""

    half: str
    known: int
    recalled: int
    unknown: int
    wrong_claims: int
    healthy: int
    flagged: int
    errors: int


def load_samples(half: str, manifest: Path = MANIFEST) -> list[Sample]:
    """The manifest's samples of ``half`` (one of :data:`HALVES`, or ``all``), in manifest order."""
    records = json.loads(manifest.read_text(encoding="utf-8"))["samples"]
    samples = [Sample(r["file"], r["half"], r["url"], r["label"], r["kind"], r.get("title", "")) for r in records]
    return [s for s in samples if half == "all" or s.half == half]


def explain_ids(path: Path, timeout: float) -> tuple[tuple[str, ...], str]:
    """The entry ids ``explain FILE --json`` names, in its order, and an error text if it failed.

    explain exits 0 when it names something and 1 when it names nothing; anything else, or output
    that is not its JSON, is an error of the run (reported, and counted as a miss).
    """
    try:
        proc = subprocess.run([sys.executable, "-m", "troubleshooter", "explain", str(path), "--json"],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return (), f"timed out after {timeout:g} s"
    if proc.returncode not in (0, 1):
        return (), f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return (), f"not JSON: {proc.stdout[:200]!r}"
    return tuple(d["id"] for d in report.get("diagnoses", [])), ""


def judge(sample: Sample, ids: tuple[str, ...], error: str) -> Outcome:
    """Score one sample: recall for known problems, silence for unknown ones and healthy logs."""
    first = ids[0] if ids else None
    if sample.kind == "known":
        correct = first == sample.label
    else:
        correct = not ids
    return Outcome(sample.file, sample.url, sample.kind, sample.label, first, ids,
                   correct and not error, error)


def run(samples: list[Sample], jobs: int, timeout: float, with_title: bool = False) -> list[Outcome]:
    """Explain every sample (``jobs`` subprocesses at a time) and judge each answer; ``with_title``: the
    thread's title, where recorded, on the line above the text (in a temporary copy)."""
    with tempfile.TemporaryDirectory(prefix="explain_corpus_") as tmp:
        def one(sample: Sample) -> Outcome:
            path = CORPUS / sample.file
            if with_title and sample.title:
                titled = Path(tmp) / Path(sample.file).name
                titled.write_text(sample.title + "\n\n" + path.read_text(encoding="utf-8"), encoding="utf-8")
                path = titled
            ids, error = explain_ids(path, timeout)
            return judge(sample, ids, error)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(one, samples))


def summarise(half: str, outcomes: list[Outcome]) -> Summary:
    """Count the outcomes of one half by kind."""
    def count(kind: str, correct: bool | None = None) -> int:
        return sum(1 for o in outcomes if o.kind == kind and (correct is None or o.correct == correct))

    return Summary(half=half, known=count("known"), recalled=count("known", True),
                   unknown=count("unknown"), wrong_claims=count("unknown", False),
                   healthy=count("healthy"), flagged=count("healthy", False),
                   errors=sum(1 for o in outcomes if o.error))


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "0/0"


def table(outcomes: list[Outcome]) -> str:
    """One line per sample: verdict, file, label, first diagnosis, the other ids named."""
    lines = [f"{'':4} {'file':48} {'label':32} {'first diagnosis':32} others"]
    for o in outcomes:
        verdict = "ok" if o.correct else ("ERR" if o.error else "MISS")
        others = ",".join(o.ids[1:]) or "-"
        lines.append(f"{verdict:4} {o.file:48} {o.label:32} {o.first or '-':32} {others}"
                     + (f"  [{o.error}]" if o.error else ""))
    return "\n".join(lines)


def report(summary: Summary) -> str:
    """The summary lines, in the issue's terms."""
    return "\n".join([
        f"half: {summary.half}",
        f"known problems named (first diagnosis == label): {_pct(summary.recalled, summary.known)}",
        f"unknown problems wrongly claimed (any diagnosis): {_pct(summary.wrong_claims, summary.unknown)}",
        f"healthy logs flagged (any diagnosis): {_pct(summary.flagged, summary.healthy)}",
        f"explain runs that failed: {summary.errors}",
    ])


def main(argv: list[str] | None = None) -> int:
    """Run the corpus half given on the command line and print the table and the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=(*HALVES, "all"), default="dev")
    parser.add_argument("--jobs", type=int, default=2, help="explain subprocesses at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per explain run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--with-title", action="store_true",
                        help="the thread's title, where the manifest records it, on the line above each text")
    args = parser.parse_args(argv)
    outcomes = run(load_samples(args.half), args.jobs, args.timeout, args.with_title)
    summary = summarise(args.half, outcomes)
    if args.json:
        print(json.dumps({"summary": asdict(summary), "samples": [asdict(o) for o in outcomes]}, indent=1))
    else:
        print(table(outcomes))
        print()
        print(report(summary))
    return 1 if summary.errors else 0


if __name__ == "__main__":
    sys.exit(main())
