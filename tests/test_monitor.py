"""ExpertUtilizationMonitor: a provoked collapse is caught and logged, a healthy run stays silent.

The main check is one 2-rank launch (ZeroMoEStrategy(ep_size=2): AutoEP's layers and counters,
gloo all-reduce of the counts) that trains a collapsed and then a healthy tiny MoE in one process
group, each with a real CSVLogger. A single-process Lightning run covers top-1 routing, dead
experts without stopping, and a model that logs no aux loss.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch

from jobs_util import read_ranks, run_job
from lightning_zeromoe.monitor import ExpertCollapseWarning, ExpertUtilizationMonitor, layer_stats

LAYERS = ("model.layers.0.mlp", "model.layers.1.mlp")
EVERY, MAX_STEPS = 5, 30
#: Tokens per window in the job: 5 steps x 2 ranks x batch 4 x 32 tokens.
WINDOW_TOKENS = 5 * 2 * 4 * 32


def test_layer_stats_by_hand():
    uniform = layer_stats("l", torch.tensor([10.0, 10, 10, 10]), top_k=2)
    assert uniform.shares == (0.5, 0.5, 0.5, 0.5) and uniform.collapse_score == 0
    assert uniform.cv == 0 and uniform.entropy == pytest.approx(1.0) and uniform.dead == ()
    # Top-2 over 4: every token picks expert 0, the second choice goes to 3.
    collapsed = layer_stats("l", torch.tensor([20.0, 0, 0, 20]), top_k=2)
    assert collapsed.shares == (1.0, 0.0, 0.0, 1.0) and collapsed.collapse_score == 1.0
    assert collapsed.dead == (1, 2) and collapsed.entropy == pytest.approx(0.5)
    # Top-1 over 8: the score is the seeds' "share of tokens" exceeding uniform, scaled to [0, 1].
    top1 = layer_stats("l", torch.tensor([60.0, 40, 0, 0, 0, 0, 0, 0]), top_k=1)
    assert top1.max_share == 0.6 and top1.collapse_score == pytest.approx((0.6 - 1 / 8) / (1 - 1 / 8))
    assert layer_stats("l", torch.zeros(4), top_k=2) is None


def read_csv(path: Path) -> list[dict[str, float]]:
    rows = []
    for row in csv.DictReader(path.open()):
        rows.append({k: float(v) for k, v in row.items() if v != ""})
    return rows


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor")
    run_job("monitor_collapse.py", "--out", str(out), timeout=600)
    ranks = read_ranks(out, 2)
    key = f"experts/{LAYERS[0]}/share_0"
    logged = {case: [r for r in read_csv(out / case / "version_0" / "metrics.csv") if key in r]
              for case in ("collapse", "healthy")}
    return ranks, logged


def test_collapse_is_caught_logged_and_stops_training(job):
    ranks, logged = job
    rank0, rank1 = ranks[0]["collapse"], ranks[1]["collapse"]
    # Both conditions in both layers, at the second window (patience=2), warned once each, on rank 0 only.
    assert sorted((a["layer"], a["kind"]) for a in rank0["alarms"]) == sorted(
        (layer, kind) for layer in LAYERS for kind in ("collapse", "dead"))
    assert {a["step"] for a in rank0["alarms"]} == {2 * EVERY}
    assert rank0["alarms"] == rank1["alarms"], "ranks must agree (they see the same all-reduced counts)"
    assert len(rank0["warnings"]) == 4 and rank1["warnings"] == []
    collapse = next(w for w in rank0["warnings"] if w.startswith(f"Router collapse in {LAYERS[0]}"))
    for hint in ("0.01", "router init", "Jitter", "AutoEP implements no router jitter", "batch"):
        assert hint.lower() in collapse.lower(), hint
    # stop_on_collapse: every rank stopped at the alarm, long before max_steps.
    assert rank0["global_step"] == rank1["global_step"] == 2 * EVERY and rank0["should_stop"]
    # What the CSVLogger received: windows at steps 5 and 10, expert 0 sees every token.
    rows = logged["collapse"]
    assert [r["step"] for r in rows] == [EVERY, 2 * EVERY]
    for row in rows:
        for layer in LAYERS:
            assert row[f"experts/{layer}/share_0"] > 0.5
            assert row[f"experts/{layer}/max_share"] == pytest.approx(1.0, abs=1e-6)
            assert row[f"experts/{layer}/dead"] >= 1
            assert row[f"experts/{layer}/tokens"] == WINDOW_TOKENS
        # The aux loss, separately from the task loss: at its ceiling when routing has collapsed.
        assert row["experts/aux_loss"] > 1.9 and row["experts/task_loss"] > 4


def test_healthy_run_stays_silent(job):
    ranks, logged = job
    for rank in ranks:
        assert rank["healthy"]["warnings"] == [] and rank["healthy"]["alarms"] == []
        assert rank["healthy"]["global_step"] == MAX_STEPS and not rank["healthy"]["should_stop"]
    rows = logged["healthy"]
    assert [r["step"] for r in rows] == list(range(EVERY, MAX_STEPS + 1, EVERY))
    for row in rows:
        for layer in LAYERS:
            shares = [row[f"experts/{layer}/share_{e}"] for e in range(4)]
            assert sum(shares) == pytest.approx(2.0)  # top-2: each token counted for two experts
            assert row[f"experts/{layer}/dead"] == 0
            # Windowed, not cumulative: the same number of tokens in every window.
            assert row[f"experts/{layer}/tokens"] == WINDOW_TOKENS
        assert 0.99 < row["experts/aux_loss"] < 1.1  # near its uniform-routing value of 1
    # Routing is noisy early on (the first window's busiest expert can see >75% of tokens) but
    # settles: by the last windows every expert is within 0.2 of the uniform 50%.
    for row in rows[-2:]:
        for layer in LAYERS:
            assert all(abs(row[f"experts/{layer}/share_{e}"] - 0.5) < 0.2 for e in range(4))


# --------------------------------------------------------------------------------- single process

def test_top1_dead_experts_warn_without_stopping_and_missing_aux_loss_is_named(tmp_path):
    """One CPU process, Lightning's default strategy: top-1 routing forced onto expert 0. Experts
    1-3 never receive a token, so after dead_steps they are reported dead; training continues
    (stop_on_collapse=False). A module that logs no aux loss gets told so."""
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from jobs.monitor_collapse import provoke_collapse
    from lightning_zeromoe.models import TinyMoEConfig, TinyMoEModule

    class MemoryLogger(Logger):
        """Keeps every log_metrics call the Trainer makes."""

        def __init__(self):
            super().__init__()
            self.calls = []

        name = "memory"
        version = 0

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    L.seed_everything(0, verbose=False)
    module = TinyMoEModule(TinyMoEConfig(top_k=1, aux_loss_weight=0.0, num_layers=1), batch_size=4, num_samples=48)
    provoke_collapse(module.model)
    monitor = ExpertUtilizationMonitor(every_n_steps=3, dead_steps=6, aux_loss_key="train/router_z_loss")
    logger = MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=logger, callbacks=[monitor],
                        enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExpertCollapseWarning)
        trainer.fit(module)
    messages = [str(w.message) for w in caught if issubclass(w.category, ExpertCollapseWarning)]
    assert trainer.global_step == 12, "stop_on_collapse=False must not stop training"
    assert sorted(a.kind for a in monitor.alarms) == ["collapse", "dead"]
    dead = next(a for a in monitor.alarms if a.kind == "dead")
    assert dead.step == 6 and "[1, 2, 3]" in dead.message
    assert any("No 'train/router_z_loss' metric is logged" in m for m in messages)
    assert len(messages) == 3, messages  # each condition once, although it persists for 4 windows
    windows = [(step, m) for step, m in logger.calls if "experts/model.layers.0.mlp/share_0" in m]
    assert [s for s, _ in windows] == [3, 6, 9, 12]
    for _, m in windows:
        assert m["experts/model.layers.0.mlp/share_0"] == 1.0 and m["experts/model.layers.0.mlp/dead"] == 3
        assert "experts/task_loss" in m and "experts/aux_loss" not in m
