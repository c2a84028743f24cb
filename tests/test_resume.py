"""Resume on another cluster shape, and ``load_full_weights`` on more ranks than ``ep_size``.

Real Lightning launches of real DeepSpeed engines on CPU processes (gloo):

* one source run, 2 ranks, EP=2, global batch 8 (4 per rank), 10 steps; ``ModelCheckpoint``
  saves step 5 (an epoch boundary) and steps 6-10 are the uninterrupted continuation;
* that checkpoint resumed on 4 ranks, EP=2 (2 samples per rank: the same global batch), and on
  2 ranks without expert parallelism. Every sample index each rank received is recorded. With
  ``shuffle=False`` the 4 ranks of step k together get the same 8 samples as the 2 ranks did,
  so the resumed losses are compared with the uninterrupted run's, and with a plain
  single-process AdamW run over the recorded global batches (the project's parity standard);
* an impossible change (the model now has 8 experts, the checkpoint 4) is refused before the
  first step;
* ``load_full_weights=True`` on 4 ranks, EP=2, from an ordinary single-process Lightning
  checkpoint: every rank's experts equal the saved ones (Lightning's own loader gets none right:
  see ``tests/jobs/full_weights_job.py --stock``).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from support.jobs import JOBS, read_ranks, run, run_job
from lightning_zeromoe.checkpoint import autoep_names
from lightning_zeromoe.checkpoint.resume import reshape as resume
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM, lm_losses

STEPS, EPOCH_STEPS, GLOBAL_BATCH, LR, SAVED_AT = 10, 5, 8, 3e-3, 5
#: fp32 everywhere. Measured max relative difference against the single-process run: 1.4e-7
#: (4 ranks) and 2.2e-7 (EP=1); summation order in the experts and in the gradient reduction.
#: Without the step-counter repair (resume.repair_optimizer_after_universal_load) it was 9.5e-4.
RTOL = 2e-6


def _digest(root: Path) -> dict[str, tuple[str, int, int]]:
    return {str(f.relative_to(root)): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_size,
                                       f.stat().st_mtime_ns) for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_source")
    run_job("train_tiny.py", "--out", str(out), "--steps", str(STEPS), "--epoch-steps", str(EPOCH_STEPS),
            "--batch-size", str(GLOBAL_BATCH // 2), "--ckpt-every", str(SAVED_AT), "--ckpt-dir", str(out / "ckpt"))
    ckpt = out / "ckpt" / f"step={SAVED_AT}.ckpt"
    assert (ckpt / "checkpoint").is_dir(), sorted(out.rglob("*"))
    return {"ranks": read_ranks(out, 2), "ckpt": ckpt, "digest": _digest(ckpt)}


def _global(ranks: list[dict], k: int) -> tuple[list[int], float]:
    """Step k's global batch (every rank's samples) and loss (the mean of the ranks' means)."""
    return sum((r["steps"][k]["indices"] for r in ranks), []), sum(r["steps"][k]["loss"] for r in ranks) / len(ranks)


def reference_losses(batches: list[list[int]]) -> list[float]:
    """One process, no DeepSpeed, no Lightning: same seed and data, AdamW over the global batches."""
    torch.manual_seed(0)
    config = TinyMoEConfig(aux_loss_weight=0.01)
    model = TinyMoELM(config)
    data = SyntheticLMData(GLOBAL_BATCH * EPOCH_STEPS, config.max_seq_len // 2 + 1, config.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for indices in batches:
        task, aux = lm_losses(model, data.tokens[indices])
        loss = (task + 0.01 * aux).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _resume_and_compare(source: dict, out: Path, devices: int, ep_size: int) -> str:
    proc = run_job("train_tiny.py", "--out", str(out), "--steps", str(STEPS), "--epoch-steps", str(EPOCH_STEPS),
                   "--devices", str(devices), "--ep-size", str(ep_size), "--batch-size", str(GLOBAL_BATCH // devices),
                   "--resume", str(source["ckpt"]), timeout=480)
    resumed = read_ranks(out, devices)
    before = source["ranks"]
    assert [len(r["steps"]) for r in resumed] == [STEPS - SAVED_AT] * devices
    assert [s["step"] for s in resumed[0]["steps"]] == list(range(SAVED_AT + 1, STEPS + 1))
    batches = [_global(before, k)[0] for k in range(SAVED_AT)]
    for k in range(STEPS - SAVED_AT):
        indices, loss = _global(resumed, k)
        want_indices, want_loss = _global(before, SAVED_AT + k)
        assert sorted(indices) == sorted(want_indices), f"step {SAVED_AT + k + 1}: another global batch"
        assert len(set(indices)) == GLOBAL_BATCH
        assert loss == pytest.approx(want_loss, rel=RTOL), f"step {SAVED_AT + k + 1}: uninterrupted {want_loss}"
        batches.append(indices)
    ref = reference_losses(batches)[SAVED_AT:]
    got = [_global(resumed, k)[1] for k in range(STEPS - SAVED_AT)]
    rel = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
    print(f"{devices} ranks, ep_size={ep_size}: max relative difference to one process {max(rel):.1e}")
    assert max(rel) < RTOL, rel
    # The losses keep changing after the resume: the optimizer state is live, not frozen.
    assert len({round(x, 6) for x in got}) == len(got)
    return proc.stdout + proc.stderr


def test_resume_on_4_ranks_continues_the_uninterrupted_run(source, tmp_path):
    log = _resume_and_compare(source, tmp_path / "four", devices=4, ep_size=2)
    lines = [line for line in log.splitlines() if "ZeroMoEStrategy: resumed" in line]
    assert len(lines) == 1, lines
    assert "(2 ranks, ep_size=2, ZeRO stage 3) on 4 ranks, ep_size=2" in lines[0]
    universal = source["ckpt"].with_name(source["ckpt"].name + ".universal")
    assert str(universal) in lines[0] and (universal / "latest_universal").is_file()
    assert _digest(source["ckpt"]) == source["digest"], "the conversion changed the user's checkpoint"


def test_resume_without_expert_parallelism(source, tmp_path):
    """EP=2 -> EP=1: AutoEP's w1/w2/w3 (weights and Adam moments) become the model's gate_up_proj / down_proj."""
    log = _resume_and_compare(source, tmp_path / "ep1", devices=2, ep_size=1)
    assert "on 2 ranks, ep_size=1, ZeRO stage 3 through DeepSpeed's universal checkpoint" in log
    zero = source["ckpt"].with_name(source["ckpt"].name + ".universal") / "checkpoint" / "zero"
    assert (zero / "model.layers.0.mlp.experts.gate_up_proj" / "exp_avg_sq.pt").is_file()
    assert (zero / "model.layers.0.mlp.gate.weight" / "exp_avg.pt").is_file()
    assert _digest(source["ckpt"]) == source["digest"], "the conversion changed the user's checkpoint"


def test_a_shape_change_that_cannot_work_is_refused_before_training(source, tmp_path):
    out = tmp_path / "refused"
    cmd = [sys.executable, str(JOBS / "train_tiny.py"), "--out", str(out), "--steps", str(STEPS), "--devices", "1",
           "--ep-size", "1", "--num-experts", "8", "--resume", str(source["ckpt"])]
    proc = run(cmd, timeout=300)
    assert proc.returncode != 0
    assert "[resume-shape-unsupported]" in proc.stderr, proc.stderr[-3000:]
    assert "model.layers.0.mlp: 4 saved, 8 now" in proc.stderr and "resume with the model that was trained" in proc.stderr
    assert "Trainer.fit` stopped" not in proc.stderr + proc.stdout and not (out / "rank0.json").exists()
    assert _digest(source["ckpt"]) == source["digest"]


def test_load_full_weights_every_rank_holds_the_saved_experts(tmp_path):
    run_job("full_weights_job.py", "--out", str(tmp_path), "--devices", "4", "--ep-size", "2", timeout=480)
    saved = torch.load(tmp_path / "plain.ckpt", weights_only=False)["state_dict"]
    fresh = TinyMoELM(TinyMoEConfig()).state_dict()
    ffn = TinyMoEConfig().ffn_hidden_size
    holders: dict[str, list[int]] = {}
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        held, experts = got["held"], got["experts"]
        assert len(experts) == 2
        for path, ids in experts.items():
            holders.setdefault(path, []).extend(ids)
            gate_up, down = saved[f"{path}.experts.gate_up_proj"], saved[f"{path}.experts.down_proj"]
            torch.testing.assert_close(held[f"{path}.experts.w1"], gate_up[ids, :ffn], rtol=0, atol=0)
            torch.testing.assert_close(held[f"{path}.experts.w3"], gate_up[ids, ffn:], rtol=0, atol=0)
            torch.testing.assert_close(held[f"{path}.experts.w2"], down[ids], rtol=0, atol=0)
            torch.testing.assert_close(held[f"{path}.router.gate.weight"], saved[f"{path}.gate.weight"], rtol=0, atol=0)
        for name, tensor in held.items():
            if ".experts." not in name and ".router." not in name:
                torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    # Ranks 0/2 and 1/3 hold experts 0-1 and 2-3; the saved experts are not the initial ones.
    assert all(sorted(ids) == [0, 0, 1, 1, 2, 2, 3, 3] for ids in holders.values())
    assert not torch.equal(saved["model.layers.0.mlp.experts.gate_up_proj"],
                           fresh["layers.0.mlp.experts.gate_up_proj"])


# ------------------------------------------------------------------ pure functions


def _saved(stage: int = 3, ep: int = 2, world: int = 2, experts: int = 4) -> resume.SavedCheckpoint:
    return resume.SavedCheckpoint(Path("/ckpt/step=5.ckpt"), "checkpoint", resume.Shape(world, ep, stage),
                                  experts={"model.layers.0.mlp": experts} if ep > 1 else {})


def test_plan_resume_same_shape_needs_no_conversion():
    assert resume.plan_resume(_saved(), resume.Shape(2, 2, 3), {"model.layers.0.mlp": 4}) is False
    assert resume.plan_resume(_saved(), resume.Shape(4, 2, 3), {"model.layers.0.mlp": 4}) is True
    assert resume.plan_resume(_saved(), resume.Shape(2, 1, 3), {"model.layers.0.mlp": 4}) is True


@pytest.mark.parametrize("target, experts, message", [
    (resume.Shape(2, 2, 2), 4, "written under ZeRO stage 3 and this run uses stage 2"),
    (resume.Shape(4, 2, 3), 8, "model.layers.0.mlp: 4 saved, 8 now"),
    (resume.Shape(6, 3, 3), 4, "ep_size=3 does not divide the saved expert count(s) [4]"),
    (resume.Shape(4, 3, 3), 4, "ep_size=3 does not divide the world size 4"),
])
def test_plan_resume_refuses_what_cannot_work(target, experts, message):
    with pytest.raises(resume.ResumeShapeError, match=r"^\[resume-shape-unsupported\] ") as err:
        resume.plan_resume(_saved(), target, {"model.layers.0.mlp": experts})
    assert message in str(err.value) and err.value.entry_id == "resume-shape-unsupported"


@pytest.mark.parametrize("fused_shape", ["gate_up_first", "hidden_first"])
def test_fuse_is_the_inverse_of_split(fused_shape):
    names = autoep_names.BlockNames()
    num, ffn, hidden = 4, 6, 5
    gate_up = torch.arange(num * 2 * ffn * hidden, dtype=torch.float32)
    gate_up = gate_up.view(num, 2 * ffn, hidden) if fused_shape == "gate_up_first" else gate_up.view(num, hidden, 2 * ffn)
    down = torch.arange(num * hidden * ffn, dtype=torch.float32)
    down = down.view(num, hidden, ffn) if fused_shape == "gate_up_first" else down.view(num, ffn, hidden)
    parts = autoep_names.split_experts({"gate_up_proj": gate_up, "down_proj": down}, names)
    assert parts["w1"].shape == parts["w3"].shape == (num, ffn, hidden) and parts["w2"].shape == (num, hidden, ffn)
    back = autoep_names.fuse_experts(parts["w1"], parts["w2"], parts["w3"], names,
                               {"gate_up_proj": tuple(gate_up.shape), "down_proj": tuple(down.shape)})
    assert torch.equal(back["gate_up_proj"], gate_up) and torch.equal(back["down_proj"], down)


def test_block_names_follow_the_preset_and_the_config():
    assert autoep_names.block_names({"preset_model": "mixtral"}).router == "gate"
    custom = autoep_names.block_names({"router_pattern": "router", "expert_w1": "w_in", "expert_w3": "w_up"})
    assert (custom.router, custom.w1, custom.w3) == ("router", "w_in", "w_up")
    assert autoep_names.own_name("router.gate.weight", custom) == "router.weight"


def test_deepspeed_private_flag_for_universal_loading_still_exists():
    """``resume.universal_loading`` flips ``DeepSpeedConfig.load_universal_checkpoint`` on a built
    engine; this fails loudly when a DeepSpeed upgrade renames it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_batch_size": 1})
    assert config.load_universal_checkpoint is False

    class Engine:
        _config = config

    with resume.universal_loading(Engine()):
        assert config.load_universal_checkpoint is True
    assert config.load_universal_checkpoint is False


def test_a_parameter_frozen_since_the_save_takes_the_universal_path_on_the_same_shape():
    """DeepSpeed's own load looks it up among the saved frozen parameters: a bare KeyError."""
    saved = dataclasses.replace(_saved(), trainable=("embed.weight", "model.layers.0.mlp.gate.weight"))
    shape, experts = resume.Shape(2, 2, 3), {"model.layers.0.mlp": 4}
    assert resume.plan_resume(saved, shape, experts, ["embed.weight", "model.layers.0.mlp.gate.weight"]) is False
    assert resume.plan_resume(saved, shape, experts, ["model.layers.0.mlp.gate.weight"]) is True


def test_the_target_ep_size_is_the_engines_autoep_layers():
    class Layer(torch.nn.Module):
        _is_autoep_layer = True

        def __init__(self, ep_size: int) -> None:
            super().__init__()
            self.ep_size = ep_size

    assert resume.engine_ep_size(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 1  # every block fell back
    assert resume.engine_ep_size(torch.nn.Sequential(Layer(2), Layer(2))) == 2
    with pytest.raises(resume.ResumeShapeError, match=r"different ep_size \[2, 4\]"):
        resume.engine_ep_size(torch.nn.Sequential(Layer(2), Layer(4)))


def _converted(tmp_path: Path) -> tuple[resume.SavedCheckpoint, Path]:
    """A source tag directory and a conversion whose marker records its fingerprint, as
    ``ensure_universal`` writes it (the files' contents do not matter to the check)."""
    tag_dir = tmp_path / "step=5.ckpt" / "checkpoint"
    tag_dir.mkdir(parents=True)
    (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"states")
    saved = resume.SavedCheckpoint(tag_dir.parent, "checkpoint", resume.Shape(2, 2, 3))
    out = resume.universal_dir(saved)
    out.mkdir()
    (out / resume.MARKER).write_text(json.dumps({"source": resume._fingerprint(saved)}))
    return saved, out


def test_every_rank_checks_the_universal_directory_it_reads(tmp_path):
    saved, out = _converted(tmp_path)
    assert resume.universal_problem(out, saved) == ""
    time.sleep(0.01)
    (saved.tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"states, saved again")
    assert "stale" in resume.universal_problem(out, saved)
    (out / resume.MARKER).unlink()  # a node whose disk has no (complete) conversion
    assert "missing or incomplete on this node" in resume.universal_problem(out, saved)


def test_a_dead_conversions_leftovers_are_removed_and_its_lock_is_free(tmp_path):
    """The lock is an ``flock``: a lock file left by a killed job does not block the next one."""
    saved, out = _converted(tmp_path)
    leftover = out.with_name(out.name + ".tmp-abc123")
    (leftover / "checkpoint").mkdir(parents=True)
    lock = out.with_name(out.name + ".lock")
    lock.write_text("")  # left behind by a job that died holding it
    said: list[str] = []
    start = time.monotonic()
    assert resume.ensure_universal(saved, {}, log=said.append) == (out, False)  # reused, not converted again
    assert time.monotonic() - start < 5
    assert not leftover.exists() and any("did not finish" in line for line in said)


def test_disk_full_is_recognised_in_torchs_wording_and_by_errno():
    from lightning_zeromoe.checkpoint.commit import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3264 vs 3156"))
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert is_disk_full(wrapped)
    assert not is_disk_full(RuntimeError("CUDA out of memory"))
