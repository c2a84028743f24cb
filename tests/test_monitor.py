"""ExpertUtilizationMonitor: a provoked collapse is caught and logged, a healthy run stays silent.

The main check is one 2-rank launch (ZeroMoEStrategy(ep_size=2): AutoEP's layers and counters,
gloo all-reduce of the counts) that trains a collapsed and then a healthy tiny MoE in one process
group, each with a real CSVLogger. A single-process Lightning run covers top-1 routing, dead
experts without stopping, and a model that logs no aux loss; another the load heatmaps, as images
in TensorBoard's event file and as PNG files next to the CSV logs. The alarms name the remedies
that apply to the model by knowledge-base fix id, with the knowledge base's own text.
"""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import pytest
import torch

from support.jobs import read_ranks, run_job
from lightning_zeromoe.observe.monitor import REMEDIES, ExpertCollapseWarning, ExpertUtilizationMonitor, layer_stats
from troubleshooter import knowledge

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
    # The remedies that apply to this model, by knowledge-base fix id, each with the entry's own text;
    # the tiny model has no choice-only bias, so bias balancing is named as not applicable, and why.
    entry = knowledge.get("router-collapse")
    applicable = [f for f in REMEDIES if f != "bias-balancing"]
    for fix_id in applicable:
        assert f"[{fix_id}] {entry.get_fix(fix_id).text}" in collapse, fix_id
    assert "Not applicable: [bias-balancing] the model has no choice-only routing bias" in collapse
    assert all(a["fix_ids"] == applicable for a in rank0["alarms"])
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
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

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
    # score_bias: the model routes with a choice-only bias, so the alarms name bias balancing too
    module = TinyMoEModule(TinyMoEConfig(top_k=1, aux_loss_weight=0.0, num_layers=1, score_bias=True), batch_size=4,
                           num_samples=48)
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
    assert all(a.fix_ids == REMEDIES for a in monitor.alarms)
    assert "[bias-balancing] " + knowledge.fix("router-collapse", "bias-balancing").text in dead.message
    assert len(messages) == 3, messages  # each condition once, although it persists for 4 windows
    windows = [(step, m) for step, m in logger.calls if "experts/model.layers.0.mlp/share_0" in m]
    assert [s for s, _ in windows] == [3, 6, 9, 12]
    for _, m in windows:
        assert m["experts/model.layers.0.mlp/share_0"] == 1.0 and m["experts/model.layers.0.mlp/dead"] == 3
        assert "experts/task_loss" in m and "experts/aux_loss" not in m


def _tensorboard_images(folder: Path) -> list[tuple[int, str, int, int]]:
    """(step, tag, width, height) of every image in a TensorBoard event file (TFRecord framing:
    length, its CRC, the Event proto, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    [path] = folder.glob("events.out.tfevents.*")
    data, i, found = path.read_bytes(), 0, []
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        found += [(event.step, v.tag, v.image.width, v.image.height) for v in event.summary.value if v.HasField("image")]
    return found


def test_load_heatmaps_go_to_tensorboard_as_images_and_next_to_the_csv_as_png(tmp_path, caplog):
    """heatmap=True: every window's layer x expert load reaches TensorBoard as an image (read back
    from its event file) and, since CSVLogger holds no images, a PNG per window next to
    metrics.csv, which the monitor says once."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from PIL import Image

    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

    L.seed_everything(0, verbose=False)
    module = TinyMoEModule(TinyMoEConfig(), batch_size=4, num_samples=48)
    monitor = ExpertUtilizationMonitor(every_n_steps=3, heatmap=True)
    loggers = [TensorBoardLogger(str(tmp_path), name="tb", version=0), CSVLogger(str(tmp_path), name="csv", version=0)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=loggers, callbacks=[monitor],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path))
    with caplog.at_level(logging.INFO):
        trainer.fit(module)
    images = _tensorboard_images(tmp_path / "tb" / "version_0")
    assert [(step, tag) for step, tag, _, _ in images] == [(s, "experts/load_heatmap") for s in (3, 6, 9, 12)]
    assert all(w > 200 and h > 100 for _, _, w, h in images)
    pngs = sorted((tmp_path / "csv" / "version_0" / "expert_load").glob("*.png"))
    assert [p.name for p in pngs] == [f"step_{s:06d}.png" for s in (3, 6, 9, 12)]
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").exists()
    assert Image.open(pngs[-1]).size[0] > 200
    folder = str(tmp_path / "csv" / "version_0" / "expert_load")
    assert monitor.heatmap_notes == [f"CSVLogger takes no images: the expert-load heatmaps are PNG files in {folder}"]
    said = [r.getMessage() for r in caplog.records if "takes no images" in r.getMessage()]
    assert said == [f"ExpertUtilizationMonitor: {monitor.heatmap_notes[0]}"]  # once, not once per window
    history = monitor.history_figure()
    assert len(history.axes) == 3  # two layers and the colour bar
