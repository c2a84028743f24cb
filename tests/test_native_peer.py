"""The capability table of ``benchmarks/native_peer.py`` (and docs/choosing.md, which carries it) against its
sources: every file it cites exists and says what the table reads in it, in the installed transformers and in
this repository; the number of transformers model directories with an EP plan and our coverage verdicts are
recounted. An upgrade of transformers that moves any of these fails here, so the page cannot drift."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from support.jobs import REPO


def _benchmark():
    spec = importlib.util.spec_from_file_location("native_peer", REPO / "benchmarks" / "native_peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BENCH = _benchmark()


def _transformers_root() -> Path:
    spec = importlib.util.find_spec("transformers")
    return Path(spec.origin).parent


@pytest.mark.parametrize("source", BENCH.SOURCES, ids=lambda s: f"{s.path}:{s.text[:30]}")
def test_each_cited_source_says_it(source):
    root = _transformers_root() if source.transformers else REPO
    path = root / source.path
    assert path.is_file(), path
    assert source.text in path.read_text(), (source.path, source.text)
    cited = f"`{source.path}`" if source.transformers else source.path
    assert cited in BENCH.CAPABILITIES, f"{cited} is checked but not cited"


def test_counts_in_the_table_are_recounted():
    models = _transformers_root() / "models"
    dirs = {p.parent.name for p in models.glob("*/*.py") if "base_model_ep_plan" in p.read_text()}
    assert len(dirs) == BENCH.EP_PLAN_DIRS
    assert f"{BENCH.EP_PLAN_DIRS} model directories define a `base_model_ep_plan`" in BENCH.CAPABILITIES
    rows = [line.split("|") for line in (REPO / "docs/reference/coverage.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| model_type")]
    verdicts = [re.split(r"[,:(]", r[3].strip())[0].strip() for r in rows]
    counts = {k: sum(v.startswith(k) for v in verdicts) for k in BENCH.COVERAGE}
    assert counts == BENCH.COVERAGE
    assert sum(counts.values()) == len(rows)


def test_choosing_page_carries_the_capability_table():
    page = (REPO / "docs/choosing.md").read_text()
    assert BENCH.CAPABILITIES.strip() in page


def test_step_profile_times_pieces_the_installed_deepspeed_still_has():
    """``benchmarks/step_profile.py`` splits ``DeepSpeedEngine.step`` by wrapping these ZeRO-3 optimizer methods
    and the gradient reduce-scatter as ``stage3.py`` imported it; a method renamed by an upgrade would read as
    0 ms there, so it fails here instead."""
    from deepspeed.runtime.zero import stage3

    spec = importlib.util.spec_from_file_location("step_profile", REPO / "benchmarks" / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    gone = [name for name in module.ZERO3_STEP_PIECES
            if not callable(getattr(stage3.DeepSpeedZeroOptimizer_Stage3, name, None))]
    assert gone == []
    assert callable(stage3.reduce_scatter_coalesced)


def test_the_parity_gate_tells_a_change_of_the_math_from_rounding(tmp_path):
    """The benchmark's gate (SGD, ``TOLERANCE``) on a small Qwen3-MoE model, single-process: the same loss
    summed in another order (each batch's rows reordered) passes, a learning rate 1 % off and a frozen router
    do not; the routing record finds the frozen router's first rerouted token."""
    import argparse

    import torch

    args = argparse.Namespace(warmup=2, steps=6, global_batch=8, seq=32)
    torch.save(torch.randint(0, 1024, (64, 32), generator=torch.Generator().manual_seed(0)), tmp_path / "tokens.pt")
    BENCH.build_model("qwen3_moe", 64, 128).save_pretrained(tmp_path / "qwen3_moe")

    def run(**kw):
        routes = []
        return BENCH.reference_losses("qwen3_moe", tmp_path, args, "sgd", routes=routes, **kw), routes

    ref, ref_routes = run()
    reordered, reordered_routes = run(reorder_seed=0)
    assert BENCH._drift(reordered, ref) <= BENCH.TOLERANCE
    assert BENCH.first_reroute(reordered_routes, ref_routes) == "none"
    for change in ("lr x1.01", "router frozen"):
        changed, routes = run(change=change)
        assert BENCH._drift(changed, ref) > 10 * BENCH.TOLERANCE, change
    assert BENCH.first_reroute(routes, ref_routes).startswith("step ")
