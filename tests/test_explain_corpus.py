"""Integrity of the real explain corpus (``tests/fixtures/explain_corpus``), read only.

The corpus was collected blind from public threads and split into a development and a test half
by a hash of each sample's URL when it was saved, so nothing in the test half can be tuned on.
These checks keep the manifest honest: every file it lists exists and no saved file is unlisted,
every label is a real knowledge-base id (or ``none`` / ``healthy``), every sample has its source
and the thread's conclusion, the split follows the stated rule, and the corpus keeps the size the
issue asks for. A third half, ``holdout2``, was collected later (2026-12-05), after the matcher
had been tuned on ``dev`` and ``test``, as a fresh held-out set, and a fourth, ``holdout3``, later still,
blind, while the matcher was being tuned on the first three; ``holdout4`` to ``holdout12`` were collected
the same way, each later still (``holdout8`` to ``holdout12`` on 2026-12-06). Each is in its half by collection
date, not by the hash rule. How explain scores on them is measured by ``benchmarks/explain_corpus.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from lightning_zeromoe.knowledge.load import load_entries

CORPUS = Path(__file__).parent / "fixtures" / "explain_corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text(encoding="utf-8"))
SAMPLES = MANIFEST["samples"]
HALVES = ("dev", "test", "holdout2", "holdout3", "holdout4", "holdout5", "holdout6", "holdout7", "holdout8",
          "holdout9", "holdout10", "holdout11", "holdout12")
HASHED = ("dev", "test")  # the halves split by the URL hash; the holdouts are by collection date
# collected after tuning had begun, each with its note in the manifest
HELD_OUT = ("holdout2", "holdout3", "holdout4", "holdout5", "holdout6", "holdout7", "holdout8", "holdout9",
            "holdout10", "holdout11", "holdout12")
# the day each holdout was collected, as its note in the manifest states it
COLLECTED = {"holdout8": "2026-12-06", "holdout9": "2026-12-06", "holdout10": "2026-12-06",
             "holdout11": "2026-12-06", "holdout12": "2026-12-06"}
FIELDS = ("file", "half", "url", "project", "date", "forms", "thread_conclusion", "conclusion_source",
          "label", "kind")


def _half_of(url: str) -> str:
    return "dev" if hashlib.sha256(url.encode("utf-8")).digest()[0] % 2 == 0 else "test"


def test_split_rule_is_stated_and_followed() -> None:
    assert "sha256" in MANIFEST["split_rule"] and "% 2 == 0" in MANIFEST["split_rule"]
    for half in HELD_OUT:
        day = COLLECTED.get(half, "2026-12-05")
        assert half in MANIFEST and day in MANIFEST[half], f"no collection note for {half}"
    assert {s["half"] for s in SAMPLES} == set(HALVES)
    misplaced = [s["file"] for s in SAMPLES if not s["file"].startswith(s["half"] + "/")]
    assert misplaced == [], f"samples outside their half's folder: {misplaced}"
    wrong = [s["file"] for s in SAMPLES if s["half"] in HASHED and s["half"] != _half_of(s["url"])]
    assert wrong == [], f"samples not in the half their URL hashes to: {wrong}"


def test_urls_are_unique_across_every_half() -> None:
    urls = [s["url"].rstrip("/").lower() for s in SAMPLES]
    twice = sorted({u for u in urls if urls.count(u) > 1})
    assert twice == [], f"threads used twice: {twice}"


def test_no_sample_comes_from_a_thread_the_patterns_or_entries_cite() -> None:
    """The texts the patterns were written from (fixtures) and the entries' sources stay out of the corpus."""
    repo = Path(__file__).parents[1]
    fixtures = repo / "tests" / "fixtures"
    cited_in = [*(fixtures / "tracebacks").rglob("*"), *(fixtures / "benign").rglob("*"),
                *(repo / "lightning_zeromoe" / "knowledge" / "entries").glob("*.toml")]
    cited = {url.rstrip("/.,").lower() for path in cited_in if path.is_file()
             for url in re.findall(r"https?://[^\s\"'<>)\]]+", path.read_text(encoding="utf-8", errors="replace"))}
    assert cited, "no cited URL found: the check would pass vacuously"
    reused = [s["file"] for s in SAMPLES if s["url"].rstrip("/").lower() in cited]
    assert reused == [], f"samples from threads the fixtures or entries cite: {reused}"


def test_every_sample_is_complete_and_sourced() -> None:
    for s in SAMPLES:
        missing = [f for f in FIELDS if not s.get(f)]
        assert missing == [], f"{s.get('file')}: missing {missing}"
        assert re.match(r"https://\S+$", s["url"]), f"{s['file']}: not a URL: {s['url']!r}"
        assert isinstance(s["forms"], list) and all(isinstance(f, str) and f for f in s["forms"]), s["file"]


def test_titles_are_recorded_from_holdout6_on() -> None:
    """From ``holdout6`` on, the manifest records each thread's title beside the paste (which may itself
    begin with the title's words, as the user typed them), so ``benchmarks/explain_corpus.py`` can run
    with and without it (``--with-title``)."""
    titled = [s for s in SAMPLES if s["half"] in ("holdout6", "holdout7", "holdout8", "holdout9", "holdout10",
                                                  "holdout11", "holdout12")]
    assert titled
    for s in titled:
        assert isinstance(s.get("title"), str) and s["title"].strip(), s["file"]


def test_files_listed_exist_once_and_nothing_unlisted() -> None:
    listed = [s["file"] for s in SAMPLES]
    assert len(listed) == len(set(listed)), "a file is listed twice"
    on_disk = sorted(str(p.relative_to(CORPUS)) for half in HALVES for p in (CORPUS / half).glob("*.txt"))
    assert sorted(listed) == on_disk
    for name in listed:
        assert (CORPUS / name).read_text(encoding="utf-8").strip(), f"{name} is empty"


def test_numbering_is_unique() -> None:
    numbers = [Path(s["file"]).name.split("_", 1)[0] for s in SAMPLES]
    assert all(re.fullmatch(r"\d{3}", n) for n in numbers)
    assert len(numbers) == len(set(numbers))


def test_each_held_out_half_is_numbered_on_from_the_halves_before_it() -> None:
    """The holdouts were collected in order (2 to 10), after dev and test: their numbers continue the corpus."""
    def numbers(halves: tuple[str, ...]) -> list[int]:
        return [int(Path(s["file"]).name[:3]) for s in SAMPLES if s["half"] in halves]

    earlier: tuple[str, ...] = HASHED
    for half in HELD_OUT:
        assert numbers((half,)), f"{half} is empty"
        assert min(numbers((half,))) > max(numbers(earlier)), f"{half} is not numbered on from {earlier}"
        earlier = (*earlier, half)


def test_labels_are_knowledge_base_ids_and_kinds_agree() -> None:
    ids = {entry.id for entry in load_entries()}
    for s in SAMPLES:
        if s["label"] == "healthy":
            assert s["kind"] == "healthy", s["file"]
        elif s["label"] == "none":
            assert s["kind"] == "unknown", s["file"]
        else:
            assert s["label"] in ids, f"{s['file']}: {s['label']!r} is not a knowledge-base id"
            assert s["kind"] == "known", s["file"]


@pytest.mark.parametrize("half", [*HALVES, None])
def test_corpus_has_the_size_the_issue_asks_for(half: str | None) -> None:
    picked = [s for s in SAMPLES if half is None or s["half"] == half]
    kinds = [s["kind"] for s in picked]
    if half == "holdout2":  # the fresh held-out set: at least 40 reports and 10 healthy logs
        assert kinds.count("known") + kinds.count("unknown") >= 40
        assert kinds.count("healthy") >= 10
        assert kinds.count("known") >= 20 and kinds.count("unknown") >= 10
    elif half in ("holdout3", "holdout4", "holdout5", "holdout6", "holdout7", "holdout8", "holdout9", "holdout10",
                  "holdout11", "holdout12"):
        # the blind sets: at least 60 texts, 35 known, 15 none, 12 healthy
        assert len(kinds) >= 60
        assert kinds.count("known") >= 35 and kinds.count("unknown") >= 15 and kinds.count("healthy") >= 12
    elif half is None:
        assert kinds.count("known") + kinds.count("unknown") >= 60
        assert kinds.count("healthy") >= 15
    else:  # each half holds every kind, so each can be measured on its own
        assert kinds.count("known") >= 10 and kinds.count("unknown") >= 5 and kinds.count("healthy") >= 3


def test_the_learned_baseline_fits_what_it_was_trained_on_and_leaves_none_and_healthy_alone() -> None:
    """``benchmarks/explain_learned_baseline.py``'s word model (a measured alternative, not shipped): on the texts
    it was fitted to it names most known problems, and it never claims where its best label is none/healthy."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import explain_learned_baseline as baseline
    from explain_corpus import load_samples

    dev = load_samples("dev")
    model = baseline.WordModel.fit(dev)
    texts = {s.file: (CORPUS / s.file).read_text(errors="replace") for s in dev}
    known = [s for s in dev if s.kind == "known"]
    named = sum(1 for s in known if baseline.claim(model, texts[s.file], 0.0) == s.label)
    assert named >= 0.8 * len(known), (named, len(known))
    for s in dev:
        best = model.ranked(baseline.features(texts[s.file]))[0][0]
        if best in ("none", "healthy"):
            assert baseline.claim(model, texts[s.file], 0.0) is None, s.file
