"""Checkpoints users can load: ZeRO-3 + AutoEP (EP=2, 2 CPU ranks) -> one safetensors file with the
model's own names, loaded into a fresh single-process model with ``strict=True``.

Two real 2-rank launches (``tests/jobs/export_job.py``), one per model family: our tiny MoE LM with
tied embeddings, saved by ``ModelCheckpoint``, and a tiny Hugging Face Mixtral (tied too) built from a
config, saved by ``trainer.save_checkpoint``. Each job trains a few steps, saves, and records the trained *engine's* logits on a
fixed batch: that is what the exported model must reproduce. Export always runs through the real
CLI in a subprocess, as users run it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from jobs_util import REPO, job_env, run_job

#: fp32 end to end; measured max |difference| ~2e-7 (expert summation order differs).
ATOL = 1e-5


def _tree_digest(root: Path) -> dict[str, tuple[str, int, int]]:
    """sha256, size and mtime of every file under root."""
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file():
            st = f.stat()
            out[str(f.relative_to(root))] = (hashlib.sha256(f.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
    return out


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", *args], capture_output=True, text=True,
                          timeout=timeout, env=job_env(), cwd=REPO)


def _train_and_export(tmp_path_factory, family: str) -> dict:
    out = tmp_path_factory.mktemp(f"export_{family}")
    t0 = time.perf_counter()
    run_job("export_job.py", "--family", family, "--out", str(out), timeout=420)
    job_s = time.perf_counter() - t0
    job = json.loads((out / "rank0.json").read_text())
    ckpt = Path(job["ckpt_path"])
    assert (ckpt / "checkpoint").is_dir() and (ckpt / "zeromoe_meta.json").is_file(), sorted(out.rglob("*"))
    before = _tree_digest(ckpt)
    t0 = time.perf_counter()
    proc = _cli(str(ckpt), str(out / "model.safetensors"))
    export_s = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    engine = [torch.load(out / f"engine_outputs_rank{r}.pt") for r in (0, 1)]
    return {"dir": out, "ckpt": ckpt, "file": out / "model.safetensors", "before": before,
            "after": _tree_digest(ckpt), "stderr": proc.stderr, "job": job,
            "engine": engine, "job_s": job_s, "export_s": export_s}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _train_and_export(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _train_and_export(tmp_path_factory, "mixtral")


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _engine_logits(run: dict) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = run["engine"]
    # Both ranks ran the same batch through the engine together; they must agree with each other.
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.allclose(a["logits"], b["logits"], atol=1e-6)
    return a["input_ids"], a["logits"]


# ------------------------------------------------------------------ why export exists


def test_deepspeed_zero_to_fp32_refuses_autoep_checkpoints(tiny):
    """The stock converter (what Lightning's convert_zero_checkpoint_to_fp32_state_dict calls) cannot
    read these checkpoints: that is the gap export fills."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(NotImplementedError, match="does not support AutoEP ZeRO-3"):
        get_fp32_state_dict_from_zero_checkpoint(str(tiny["ckpt"]))


def test_shards_use_autoep_names_and_meta_maps_them_back(tiny):
    """DeepSpeed's shards name the router and experts AutoEP's way; zeromoe_meta.json, written by the
    strategy at save time, maps them to the model's own names."""
    shard = torch.load(tiny["ckpt"] / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    saved = {n for group in shard["param_shapes"] for n in group}
    assert "model.layers.0.mlp.router.gate.weight" in saved and "model.layers.0.mlp.experts.w1" in saved
    assert "model.lm_head.weight" not in saved  # tied: DeepSpeed stores only the embedding
    meta = json.loads((tiny["ckpt"] / "zeromoe_meta.json").read_text())
    assert meta["prefix"] == "model." and meta["ep_size"] == 2 and meta["world_size"] == 2
    assert meta["params"]["model.layers.0.mlp.router.gate.weight"] == "layers.0.mlp.gate.weight"
    assert meta["experts"][0]["targets"] == {"gate_up": "layers.0.mlp.experts.gate_up_proj",
                                            "down": "layers.0.mlp.experts.down_proj"}
    assert meta["tied"] == [["embed.weight", "lm_head.weight"]]


# ------------------------------------------------------------------ our tiny model


def test_tiny_export_loads_strict_and_reproduces_engine(tiny):
    from lightning_zeromoe.models import TinyMoEConfig, TinyMoELM

    state = _load(tiny["file"])
    assert not any(".router." in k or ".experts.w" in k for k in state), "AutoEP names leaked into the export"
    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(**tiny["job"]["config"]))
    assert set(state) == set(model.state_dict()), "export keys differ from the model's own state_dict keys"
    ids, want = _engine_logits(tiny)
    with torch.no_grad():
        untrained = model(ids)[0]
    assert (untrained - want).abs().max() > 1e-2, "the reference must differ from an untrained model"
    model.load_state_dict(state, strict=True)
    # The tie survives: one tensor under both names, equal in the file too.
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(state["lm_head.weight"], state["embed.weight"])
    with torch.no_grad():
        got = model(ids)[0]
    diff = (got - want).abs().max().item()
    print(f"tiny: max |exported - engine| = {diff:.2e}; job {tiny['job_s']:.1f} s, export CLI {tiny['export_s']:.1f} s")
    assert diff < ATOL


def test_export_reports_progress_and_never_modifies_the_source(tiny):
    assert "[zeromoe-export] reading 2 ranks' shards" in tiny["stderr"] and "wrote 18 tensors" in tiny["stderr"]
    assert tiny["before"] == tiny["after"], "the export changed the checkpoint directory"
    assert len(tiny["before"]) >= 6  # latest, meta, 2 model + 2 optimizer shards (+ DeepSpeed's scripts)


def test_export_dtype_and_no_silent_overwrite(tiny, tmp_path):
    out = tmp_path / "bf16.safetensors"
    proc = _cli(str(tiny["ckpt"]), str(out), "--dtype", "bfloat16", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    bf16 = _load(out)
    fp32 = _load(tiny["file"])
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    stamp = out.stat().st_mtime_ns
    again = _cli(str(tiny["ckpt"]), str(out))
    assert again.returncode == 2 and "already exists" in again.stderr and "--overwrite" in again.stderr
    assert out.stat().st_mtime_ns == stamp


def test_tiny_4_ranks_experts_replicated_over_expert_data_parallel_groups(tmp_path):
    """World 4, EP 2: each expert-parallel rank's experts are ZeRO-partitioned over its 2-rank
    expert-data-parallel group ([0, 2] and [1, 3]), a layout the 2-rank runs do not have."""
    out = tmp_path / "run"
    run_job("export_job.py", "--family", "tiny", "--devices", "4", "--out", str(out), timeout=600)
    job = json.loads((out / "rank0.json").read_text())
    shard = torch.load(Path(job["ckpt_path"]) / "checkpoint" / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
                       weights_only=False)
    groups = shard["optimizer_state_dict"]["ds_zero_partition_groups"]
    assert [g["partition_ranks"] for g in groups] == [[0, 1, 2, 3], [0, 2]]
    proc = _cli(job["ckpt_path"], str(tmp_path / "m.safetensors"))
    assert proc.returncode == 0, proc.stderr
    from lightning_zeromoe.models import TinyMoEConfig, TinyMoELM

    model = TinyMoELM(TinyMoEConfig(**job["config"]))
    model.load_state_dict(_load(tmp_path / "m.safetensors"), strict=True)
    ref = torch.load(out / "engine_outputs_rank0.pt")
    with torch.no_grad():
        assert (model(ref["input_ids"])[0] - ref["logits"]).abs().max() < ATOL


# ------------------------------------------------------------------ Hugging Face Mixtral


def test_mixtral_export_loads_strict_and_with_from_pretrained(mixtral, tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    state = _load(mixtral["file"])
    config = MixtralConfig(**{k: v for k, v in mixtral["job"]["config"].items()
                              if k not in ("architectures", "transformers_version")})
    fresh = MixtralForCausalLM(config)
    assert set(state) == set(fresh.state_dict()), (
        f"missing {set(fresh.state_dict()) - set(state)}, extra {set(state) - set(fresh.state_dict())}")
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.1.mlp.gate.weight" in state
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    ids, want = _engine_logits(mixtral)
    fresh.load_state_dict(state, strict=True)
    fresh.eval()
    with torch.no_grad():
        got = fresh(input_ids=ids, use_cache=False).logits
    diff = (got - want).abs().max().item()

    # from_pretrained: the config plus the exported file as model.safetensors, nothing else.
    config.save_pretrained(tmp_path)
    shutil.copyfile(mixtral["file"], tmp_path / "model.safetensors")
    loaded, info = MixtralForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded.eval()
    with torch.no_grad():
        got_pretrained = loaded(input_ids=ids, use_cache=False).logits
    diff_pretrained = (got_pretrained - want).abs().max().item()
    print(f"mixtral: max |exported - engine| = {diff:.2e} (load_state_dict), {diff_pretrained:.2e} (from_pretrained); "
          f"job {mixtral['job_s']:.1f} s, export CLI {mixtral['export_s']:.1f} s")
    assert diff < ATOL and diff_pretrained < ATOL
    assert mixtral["before"] == mixtral["after"]


# ------------------------------------------------------------------ bad input, through the CLI


def _copy_ckpt(run: dict, dst: Path) -> Path:
    shutil.copytree(run["ckpt"], dst)
    return dst


def _assert_refused(proc: subprocess.CompletedProcess, *phrases: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("zeromoe-export: error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_missing_directory(tmp_path):
    proc = _cli(str(tmp_path / "nope"), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "checkpoint directory not found", "trainer.save_checkpoint")
    assert not (tmp_path / "out.safetensors").exists()


def test_console_script_is_the_same_cli(tmp_path):
    script = Path(sys.executable).parent / "zeromoe-export"
    if not script.exists():
        pytest.skip("package not installed with its console scripts (pip install -e .)")
    proc = subprocess.run([str(script), str(tmp_path / "nope"), str(tmp_path / "o.safetensors")], capture_output=True,
                          text=True, timeout=120, env=job_env())
    _assert_refused(proc, "checkpoint directory not found")


def test_export_needs_no_model_code_and_no_deepspeed(mixtral, tmp_path):
    """Export reads the files only: neither transformers, DeepSpeed, Lightning nor our model module is
    imported, so it runs where the model code is not installed."""
    code = ("import sys; from lightning_zeromoe.checkpoint import export; "
            f"export({str(mixtral['ckpt'])!r}, {str(tmp_path / 'm.safetensors')!r}, progress=False); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'deepspeed', 'lightning'})"
            " + sorted(m for m in sys.modules if m == 'lightning_zeromoe.models'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=job_env(),
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
    mine, reference = _load(tmp_path / "m.safetensors"), _load(mixtral["file"])
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)


def test_truncated_shard(tiny, tmp_path):
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    shard = ckpt / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    before = _tree_digest(ckpt)
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncated or corrupt", "Copy it again")
    assert not (tmp_path / "out.safetensors").exists()
    assert _tree_digest(ckpt) == before


def test_missing_rank_shard(tiny, tmp_path):
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    (ckpt / "checkpoint" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "the run had 2 ranks", "missing: [1]")


def test_checkpoint_not_written_by_the_strategy(tiny, tmp_path):
    """A DeepSpeed checkpoint without our meta (e.g. plain DeepSpeedStrategy, or an older version)."""
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    (ckpt / "zeromoe_meta.json").unlink()
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "no zeromoe_meta.json", "not written by ZeroMoEStrategy", "trainer.save_checkpoint")


def test_mismatched_model(tiny, mixtral, tmp_path):
    """Shards of one model, description of another (files mixed between runs)."""
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    shutil.copyfile(mixtral["ckpt"] / "zeromoe_meta.json", ckpt / "zeromoe_meta.json")
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "do not match the model described by zeromoe_meta.json", "different runs")
    assert not (tmp_path / "out.safetensors").exists()


def test_output_inside_checkpoint_is_refused(tiny):
    proc = _cli(str(tiny["ckpt"]), str(tiny["ckpt"] / "model.safetensors"))
    _assert_refused(proc, "never modified")
    assert not (tiny["ckpt"] / "model.safetensors").exists()
