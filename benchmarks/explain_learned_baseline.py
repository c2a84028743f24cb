"""Would a word model learned from the labelled corpus name what ``explain``'s evidence misses?

A check of one alternative to reading evidence (issue 36): a Bernoulli naive Bayes model over the words
and word pairs of each text, trained on the labels of every set collected *before* the one it is tested
on (so each test set is unseen by the model, as it was by its collector), consulted only where
``explain`` names nothing. It claims the most likely label when that label is a knowledge-base entry
and its log-probability beats the runner-up's by at least ``--margin``; ``none`` and ``healthy`` are
classes too, so a text like an earlier unknown problem or healthy log is left alone.

For each held-out set from ``holdout3`` on, it prints explain alone and explain with the model, in the
benchmark's three figures (known problems named, unknown problems wrongly claimed, healthy logs flagged):

    PYTHONPATH=$PWD python benchmarks/explain_learned_baseline.py --jobs 2 --margins 0 5 10

explain runs as in ``benchmarks/explain_corpus.py`` (a subprocess per text, the first diagnosis counts);
the model is this file's, nothing of it is shipped.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from explain_corpus import CORPUS, HALVES, Sample, judge, load_samples, run, summarise  # noqa: E402

#: Words of three or more characters (underscores split them, as pastes often lose them) and pairs of
#: Chinese characters.
_WORD = re.compile(r"[a-z][a-z0-9]{2,}|[\u4e00-\u9fff]{2}")
#: Smoothing of the per-class word probabilities.
ALPHA = 0.1


def features(text: str) -> frozenset[str]:
    """The words and adjacent word pairs of a text, lower-cased."""
    words = _WORD.findall(text.lower().replace("_", " "))
    return frozenset(words + [f"{a} {b}" for a, b in zip(words, words[1:])])


@dataclass
class WordModel:
    """Per label: how many training texts it has, and in how many of them each feature occurs; and every
    feature of the training texts."""

    texts: Counter[str]
    seen: dict[str, Counter[str]]
    vocabulary: frozenset[str]

    @classmethod
    def fit(cls, samples: list[Sample]) -> "WordModel":
        texts: Counter[str] = Counter()
        seen: dict[str, Counter[str]] = {}
        for s in samples:
            texts[s.label] += 1
            seen.setdefault(s.label, Counter()).update(features((CORPUS / s.file).read_text(errors="replace")))
        return cls(texts, seen, frozenset().union(*seen.values()))

    def ranked(self, feats: frozenset[str]) -> list[tuple[str, float]]:
        """Labels by log-probability of the features present (those no training text had are skipped)."""
        total = sum(self.texts.values())
        known = [f for f in feats if f in self.vocabulary]
        scores = {label: math.log(n / total) + sum(math.log((self.seen[label][f] + ALPHA) / (n + 2 * ALPHA))
                                                   for f in known)
                  for label, n in self.texts.items()}
        return sorted(scores.items(), key=lambda kv: -kv[1])


def claim(model: WordModel, text: str, margin: float) -> str | None:
    """The entry the model names, or None (its best label is none/healthy, or not by ``margin``)."""
    (best, top), (_, second) = model.ranked(features(text))[:2]
    return best if best not in ("none", "healthy") and top - second >= margin else None


def figures(samples: list[Sample], first: dict[str, str | None]) -> str:
    """``known k/K, wrong w/W, flagged f/F`` for each sample's first diagnosis in ``first``, judged as
    ``explain_corpus.py`` judges explain's."""
    s = summarise("", [judge(sample, (first[sample.file],) if first[sample.file] else (), "") for sample in samples])
    return f"known {s.recalled}/{s.known}, wrong {s.wrong_claims}/{s.unknown}, flagged {s.flagged}/{s.healthy}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 5.0, 10.0])
    args = parser.parse_args(argv)
    by_half = {half: load_samples(half) for half in HALVES}
    outcomes = run([s for half in HALVES for s in by_half[half]], args.jobs, args.timeout)
    explained = {o.file: o.first for o in outcomes}
    for i, half in enumerate(HALVES):
        if i < HALVES.index("holdout3"):
            continue
        model = WordModel.fit([s for earlier in HALVES[:i] for s in by_half[earlier]])
        tested = by_half[half]
        print(f"{half} (model trained on {', '.join(HALVES[:i])}):")
        print(f"  explain alone:              {figures(tested, explained)}")
        for margin in args.margins:
            combined = {s.file: explained[s.file] or claim(model, (CORPUS / s.file).read_text(errors="replace"),
                                                           margin) for s in tested}
            print(f"  explain, then model (>={margin:g}): {figures(tested, combined)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
