"""Checkpoints users can load: ZeRO-1/2/3 + AutoEP (EP=2, 2 CPU ranks) -> a Hugging Face model
directory (or one safetensors file) with the model's own names, loaded into a fresh
single-process model.

One real 2-rank launch (``tests/jobs/export_job.py``, the ``export_runs`` fixture of
``conftest.py``, shared with ``test_export_safety.py``): our tiny MoE LM with tied embeddings, saved
by ``ModelCheckpoint``; a tiny Hugging Face Mixtral (tied too) built from a config, saved by
``trainer.save_checkpoint``; and several variants (ZeRO-1, ZeRO-2 with a frozen embedding, ZeRO-3
with a frozen embedding, DeepSeek-V3, PEFT LoRA, a wider model for the memory bound); one 4-rank
launch of the tiny MoE. Each run records the trained *engine's* logits on a fixed batch: that is what the
exported model must reproduce. Export runs through the real CLI in a subprocess, as users run
it, except where a check needs the Python API.
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

from support.jobs import JOBS, REPO, job_env, run_job

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


#: Small enough that the tiny models' exports have several shards.
SHARD = "150KB"


def _export(out: Path) -> dict:
    """One family's run of the shared launch (``export_runs``), exported by the CLI twice: one file,
    and an HF directory of several shards."""
    job = json.loads((out / "rank0.json").read_text())
    ckpt = Path(job["ckpt_path"])
    assert (ckpt / "checkpoint").is_dir() and (ckpt / "zeromoe_meta.json").is_file(), sorted(out.rglob("*"))
    before = _tree_digest(ckpt)
    t0 = time.perf_counter()
    proc = _cli(str(ckpt), str(out / "model.safetensors"))
    export_s = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    hf = _cli(str(ckpt), str(out / "hf"), "--max-shard-size", SHARD)
    assert hf.returncode == 0, hf.stderr[-4000:]
    engine = [torch.load(out / f"engine_outputs_rank{r}.pt") for r in (0, 1)]
    return {"dir": out, "ckpt": ckpt, "file": out / "model.safetensors", "hf": out / "hf", "before": before,
            "after": _tree_digest(ckpt), "stderr": proc.stderr, "hf_stderr": hf.stderr, "job": job,
            "engine": engine, "job_s": job["wall_seconds"], "export_s": export_s}


@pytest.fixture(scope="module")
def tiny(export_runs):
    return _export(export_runs / "tiny")


@pytest.fixture(scope="module")
def mixtral(export_runs):
    return _export(export_runs / "mixtral")


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
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

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
    assert "[zeromoe-export] reading 4 shard files of a ZeRO stage-3 checkpoint (2 ranks, ep_size=2)" in tiny["stderr"]
    assert "wrote 18 tensors" in tiny["stderr"]
    assert "[zeromoe-export] writing" in tiny["hf_stderr"] and "shard(s)" in tiny["hf_stderr"]  # the bar, with bytes
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
    _assert_refused(again, "export-output-path", "already exists", "--overwrite")
    assert out.stat().st_mtime_ns == stamp


def test_tiny_4_ranks_experts_replicated_over_expert_data_parallel_groups(tmp_path):
    """World 4, EP 2: each expert-parallel rank's experts are ZeRO-partitioned over its 2-rank
    expert-data-parallel group ([0, 2] and [1, 3]), a layout the 2-rank runs do not have."""
    out = tmp_path / "run" / "tiny"
    run_job("export_job.py", "--family", "tiny", "--devices", "4", "--out", str(out.parent), timeout=600)
    job = json.loads((out / "rank0.json").read_text())
    shard = torch.load(Path(job["ckpt_path"]) / "checkpoint" / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
                       weights_only=False)
    groups = shard["optimizer_state_dict"]["ds_zero_partition_groups"]
    assert [g["partition_ranks"] for g in groups] == [[0, 1, 2, 3], [0, 2]]
    proc = _cli(job["ckpt_path"], str(tmp_path / "m.safetensors"))
    assert proc.returncode == 0, proc.stderr
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    model = TinyMoELM(TinyMoEConfig(**job["config"]))
    model.load_state_dict(_load(tmp_path / "m.safetensors"), strict=True)
    ref = torch.load(out / "engine_outputs_rank0.pt")
    with torch.no_grad():
        assert (model(ref["input_ids"])[0] - ref["logits"]).abs().max() < ATOL


# ------------------------------------------------------------------ Hugging Face Mixtral


def test_mixtral_export_loads_strict(mixtral):
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

    print(f"mixtral: max |exported - engine| = {diff:.2e} (load_state_dict); job {mixtral['job_s']:.1f} s, "
          f"export CLI {mixtral['export_s']:.1f} s")
    assert diff < ATOL
    assert mixtral["before"] == mixtral["after"]


def _check_index(out_dir: Path) -> dict[str, torch.Tensor]:
    """The index names every tensor of every shard exactly once, in the shard that holds it."""
    from safetensors import safe_open

    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    shards = sorted(out_dir.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {f.name for f in shards}
    seen: dict[str, str] = {}
    state = {}
    for f in shards:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():
                assert key not in seen, f"{key} in {seen.get(key)} and {f.name}"
                seen[key] = f.name
                state[key] = handle.get_tensor(key)
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    return state


def test_mixtral_hf_directory_loads_with_from_pretrained_alone(mixtral):
    """What a user gets: AutoModelForCausalLM.from_pretrained(out_dir), no config written by hand."""
    from transformers import AutoModelForCausalLM

    out = mixtral["hf"]
    assert {"config.json", "model.safetensors.index.json", "zeromoe_export.json"} <= {f.name for f in out.iterdir()}
    state = _check_index(out)
    single = _load(mixtral["file"])
    assert state.keys() == single.keys() and all(torch.equal(state[k], single[k]) for k in state)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, want = _engine_logits(mixtral)
    loaded.eval()
    with torch.no_grad():
        got = loaded(input_ids=ids, use_cache=False).logits
    diff = (got - want).abs().max().item()
    print(f"mixtral: max |from_pretrained(export dir) - engine| = {diff:.2e}")
    assert diff < ATOL
    meta = json.loads((mixtral["ckpt"] / "zeromoe_meta.json").read_text())
    assert meta["version"] == 2 and {e["layout_source"] for e in meta["experts"]} == {"model"}
    assert mixtral["before"] == mixtral["after"]


def test_tiny_hf_directory_shards_match_the_single_file(tiny):
    state = _check_index(tiny["hf"])
    single = _load(tiny["file"])
    assert state.keys() == single.keys() and all(torch.equal(state[k], single[k]) for k in state)
    config = json.loads((tiny["hf"] / "config.json").read_text())
    assert config["zeromoe_model_class"] == "lightning_zeromoe.reference.models.TinyMoELM"
    assert {k: v for k, v in config.items() if k != "zeromoe_model_class"} == tiny["job"]["config"]


# ------------------------------------------------------------------ every kind of checkpoint


@pytest.fixture(scope="module")
def variants(export_runs):
    out = export_runs / "variants"
    return {"dir": out, "runs": json.loads((out / "rank0.json").read_text())}


def _export_run(variants: dict, name: str, tmp_path: Path, **kwargs) -> tuple[Path, dict]:
    """Export one run's checkpoint (Python API) into an HF directory; the source must not change."""
    from lightning_zeromoe.checkpoint import export

    ckpt = Path(variants["runs"][name]["ckpt_path"])
    before = _tree_digest(ckpt)
    out = export(ckpt, tmp_path / name, max_shard_size=SHARD, progress=False, **kwargs)
    assert _tree_digest(ckpt) == before, f"{name}: the export changed the checkpoint directory"
    return out, torch.load(variants["dir"] / name / "engine_outputs_rank0.pt")


def _hf_dir_state(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(out.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


@pytest.mark.parametrize("name", ["stage1", "stage2_frozen", "stage3_frozen"])
def test_zero_stage_1_2_and_frozen_embedding_export(variants, name, tmp_path):
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    run = variants["runs"][name]
    out, ref = _export_run(variants, name, tmp_path)
    meta = json.loads((Path(run["ckpt_path"]) / "zeromoe_meta.json").read_text())
    assert meta["zero_stage"] == int(name[5])
    assert meta["frozen"] == (["embed.weight"] if run["frozen"] else [])
    model = TinyMoELM(TinyMoEConfig(**run["config"]))
    model.load_state_dict(_hf_dir_state(out), strict=True)
    import lightning as L

    from lightning_zeromoe.reference.models import TinyMoEModule

    L.seed_everything(0, verbose=False)  # the job's seed: the model as the run started
    initial = TinyMoEModule(TinyMoEConfig(**run["config"]), batch_size=4, num_samples=64).model
    # A frozen embedding is exported as it is (= as initialised); trained tensors moved.
    assert torch.equal(model.embed.weight, initial.embed.weight) == bool(run["frozen"])
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)
    with torch.no_grad():
        diff = (model(ref["input_ids"])[0] - ref["logits"]).abs().max().item()
    print(f"{name}: max |exported - engine| = {diff:.2e}")
    assert diff < ATOL


def test_deepseek_v3_exports_its_score_correction_bias(variants, tmp_path):
    from transformers import AutoModelForCausalLM

    out, ref = _export_run(variants, "deepseek_v3", tmp_path)
    state = _hf_dir_state(out)
    biases = [k for k in state if k.endswith("mlp.gate.e_score_correction_bias")]
    assert sorted(biases) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded.eval()
    with torch.no_grad():
        diff = (loaded(input_ids=ref["input_ids"], use_cache=False).logits - ref["logits"]).abs().max().item()
    print(f"deepseek_v3: max |from_pretrained(export dir) - engine| = {diff:.2e}")
    assert diff < ATOL


def test_lora_run_exports_merged_model_and_peft_adapter(variants, tmp_path):
    """The merged directory loads with from_pretrained alone; the adapter loads with PEFT onto the
    base weights the run started from (rebuilt from the job's seed) and gives the same logits."""
    import lightning as L
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(JOBS))
    from train_hf import build_hf_model

    out, ref = _export_run(variants, "lora", tmp_path)
    merged = _hf_dir_state(out)
    assert not any("lora_" in k or "base_layer" in k for k in merged), "PEFT names leaked into the merged export"
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded.eval()
    with torch.no_grad():
        diff_merged = (loaded(input_ids=ref["input_ids"], use_cache=False).logits - ref["logits"]).abs().max().item()
    adapter = _load(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all(k.startswith("base_model.model.") and (".lora_A.weight" in k or ".lora_B.weight" in k)
                           for k in adapter)
    L.seed_everything(0, verbose=False)
    base = build_hf_model("mixtral")
    with_adapter = PeftModel.from_pretrained(base, out / "adapter")
    with_adapter.eval()
    with torch.no_grad():
        diff_adapter = (with_adapter(input_ids=ref["input_ids"], use_cache=False).logits - ref["logits"]).abs().max().item()
    print(f"lora: max |merged - engine| = {diff_merged:.2e}, |base + adapter - engine| = {diff_adapter:.2e}")
    assert diff_merged < ATOL and diff_adapter < ATOL


def test_streaming_export_memory_stays_near_one_shard(variants, tmp_path):
    """Export a model whose weights are many times the shard size. The exporter's own memory, the
    peak of anonymous RSS (RssAnon, sampled every millisecond by a thread, from after the imports
    and a warm-up of the shard planner, whose first call imports ~40 MB of modules), grows by at
    most 2 x max(max_shard_size, largest tensor) + 8 MiB: the shard being written and safetensors'
    serialisation copy of it (measured 12.3 MiB). Holding the whole model, as the previous exporter
    did, exceeds it. File-backed pages (source shards read through mappings, library code touched
    for the first time) are not the exporter's to hold: total RSS (VmHWM) grew 31.8-37.7 MiB over
    runs, 5 MiB of noise, so it is printed, not asserted."""
    ckpt = variants["runs"]["wide"]["ckpt_path"]
    shard = 1_000_000
    code = f"""
import json, math, re, threading, time, torch, safetensors.torch, rich.progress
from huggingface_hub import split_torch_state_dict_into_shards
from pathlib import Path
split_torch_state_dict_into_shards({{"w": torch.empty(2, device="meta")}})
from lightning_zeromoe.checkpoint import export
from lightning_zeromoe.checkpoint.meta import read_meta
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
meta = read_meta(Path({ckpt!r}) / "zeromoe_meta.json")
anon_peak, done = [status("RssAnon")], threading.Event()
def sample():
    while not done.is_set():
        anon_peak[0] = max(anon_peak[0], status("RssAnon"))
        time.sleep(0.001)
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
base, anon_base = status("VmRSS"), status("RssAnon")
sampler = threading.Thread(target=sample)
sampler.start()
export({ckpt!r}, {str(tmp_path / "wide")!r}, max_shard_size={shard}, progress=False)
done.set()
sampler.join()
sizes = [4 * math.prod(s) for s in meta.shapes.values()]
print(json.dumps({{"base": base, "peak": status("VmHWM"), "anon_base": anon_base, "anon_peak": anon_peak[0],
                  "model": sum(sizes), "largest": max(sizes)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=job_env(),
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 2 * max(shard, m["largest"]) + 8 * 2**20
    grew = m["anon_peak"] - m["anon_base"]
    print(f"wide: model {m['model'] / 2**20:.1f} MiB fp32, largest tensor {m['largest'] / 2**20:.1f} MiB, "
          f"peak anonymous RSS grew {grew / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB; total RSS "
          f"peak grew {(m['peak'] - m['base']) / 2**20:.1f} MiB)")
    assert m["model"] > 50 * shard and m["model"] > 2 * bound, "the model must be well over the bound"
    assert grew < bound
    assert len(list((tmp_path / "wide").glob("model-*.safetensors"))) >= 10


def test_checkpoint_holding_a_custom_class_is_refused_unless_trusted(tiny, tmp_path):
    """A model shard whose client state holds an object of a custom class: the safe load refuses
    it, names the class, and runs nothing; --trust-checkpoint reads it and exports the same model."""
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    module_dir = tmp_path / "userpkg"
    module_dir.mkdir()
    marker = tmp_path / "code-ran"
    (module_dir / "user_hparams.py").write_text(
        "from pathlib import Path\n"
        "class RunConfig:\n"
        "    def __setstate__(self, state):\n"
        f"        Path({str(marker)!r}).write_text('unpickled')\n"
        "        self.__dict__.update(state)\n")
    shard = ckpt / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    sys.path.insert(0, str(module_dir))
    try:
        import user_hparams

        state = torch.load(shard, weights_only=False)
        obj = user_hparams.RunConfig()
        obj.lr = 0.1
        state["hyper_parameters"] = {"run": obj}
        torch.save(state, shard)
        marker.unlink(missing_ok=True)
    finally:
        sys.path.remove(str(module_dir))
    env_path = f"{module_dir}:{job_env().get('PYTHONPATH', '')}"
    run = lambda *a: subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=180, env={**job_env(), "PYTHONPATH": env_path}, cwd=REPO)
    refused = run(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(refused, "export-untrusted-object", "user_hparams.RunConfig", "--trust-checkpoint")
    assert not marker.exists(), "the safe load ran code from the checkpoint"
    assert not (tmp_path / "out.safetensors").exists()
    trusted = run(str(ckpt), str(tmp_path / "out.safetensors"), "--trust-checkpoint", "--quiet")
    assert trusted.returncode == 0, trusted.stderr
    assert marker.exists()  # what the flag allows, and why it is off by default
    mine, reference = _load(tmp_path / "out.safetensors"), _load(tiny["file"])
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)


# ------------------------------------------------------------------ bad input, through the CLI


def _copy_ckpt(run: dict, dst: Path) -> Path:
    shutil.copytree(run["ckpt"], dst)
    return dst


def _assert_refused(proc: subprocess.CompletedProcess, entry: str, *phrases: str) -> None:
    """Exit 2, one error line that starts with the knowledge-base entry id, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("zeromoe-export: error:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"zeromoe-export: error: [{entry}] "), lines[0]
    assert "Traceback" not in proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_missing_directory(tmp_path):
    proc = _cli(str(tmp_path / "nope"), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "export-not-a-checkpoint", "checkpoint directory not found", "trainer.save_checkpoint")
    assert not (tmp_path / "out.safetensors").exists()


def test_console_script_is_the_same_cli(tmp_path):
    script = Path(sys.executable).parent / "zeromoe-export"
    if not script.exists():
        pytest.skip("package not installed with its console scripts (pip install -e .)")
    proc = subprocess.run([str(script), str(tmp_path / "nope"), str(tmp_path / "o.safetensors")], capture_output=True,
                          text=True, timeout=120, env=job_env())
    _assert_refused(proc, "export-not-a-checkpoint", "checkpoint directory not found")


def test_export_needs_no_model_code_and_no_deepspeed(mixtral, tmp_path):
    """Export reads the files only: neither transformers, DeepSpeed, Lightning nor our model module is
    imported, so it runs where the model code is not installed."""
    code = ("import sys; from lightning_zeromoe.checkpoint import export; "
            f"export({str(mixtral['ckpt'])!r}, {str(tmp_path / 'm.safetensors')!r}, progress=False); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'deepspeed', 'lightning'})"
            " + sorted(m for m in sys.modules if m == 'lightning_zeromoe.reference.models'))")
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
    _assert_refused(proc, "export-shard-corrupt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncated or corrupt", "Copy it again")
    assert not (tmp_path / "out.safetensors").exists()
    assert _tree_digest(ckpt) == before


def test_missing_rank_shard(tiny, tmp_path):
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    (ckpt / "checkpoint" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "export-shards-mismatch", "the run had 2 ranks", "missing: [1]")


def test_checkpoint_not_written_by_the_strategy(tiny, tmp_path):
    """A DeepSpeed checkpoint without our meta (e.g. plain DeepSpeedStrategy, or an older version)."""
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    (ckpt / "zeromoe_meta.json").unlink()
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "export-not-a-checkpoint", "no zeromoe_meta.json", "not written by ZeroMoEStrategy", "trainer.save_checkpoint")


def test_mismatched_model(tiny, mixtral, tmp_path):
    """Shards of one model, description of another (files mixed between runs)."""
    ckpt = _copy_ckpt(tiny, tmp_path / "ckpt")
    shutil.copyfile(mixtral["ckpt"] / "zeromoe_meta.json", ckpt / "zeromoe_meta.json")
    proc = _cli(str(ckpt), str(tmp_path / "out.safetensors"))
    _assert_refused(proc, "export-shards-mismatch", "do not match the model described by zeromoe_meta.json", "different runs")
    assert not (tmp_path / "out.safetensors").exists()


def test_output_inside_checkpoint_is_refused(tiny):
    proc = _cli(str(tiny["ckpt"]), str(tiny["ckpt"] / "model.safetensors"))
    _assert_refused(proc, "export-output-path", "never modified")
    assert not (tiny["ckpt"] / "model.safetensors").exists()
