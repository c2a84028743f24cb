"""PEFT LoRA with frozen experts under expert parallelism and ZeRO-3: save, resume, export.

The common fine-tune of a large MoE: LoRA on attention (q_proj, v_proj), base weights and experts
frozen, ``ZeroMoEStrategy(ep_size=2)``. DeepSpeed 0.19.8 alone refuses to save it
(``tests/fixtures/tracebacks/real_autoep_frozen_experts.txt``); the strategy writes the frozen
experts beside DeepSpeed's files (:mod:`lightning_zeromoe.checkpoint.frozen_experts`).

One real 2-rank ``torchrun`` launch of ``tests/jobs/lora_ep_job.py`` (its docstring lists the runs:
``A`` trains and saves with ``ep_size=2``; ``B`` resumes it on the same shape, ``C`` with
``ep_size=1``, ``D`` resumes ``C``'s checkpoint with ``ep_size=2``, ``E`` resumes ``A``'s with
AutoEP's layer at ``ep_size=1``, one expert-data-parallel group of 2 ranks; ``T``, ``U``, ``V``: LoRA
on the fused 3-D expert tensors too, PEFT ``target_parameters``, whose MoE blocks fall back to ZeRO-3
leaf modules: ``T`` trains and saves with ``ep_size=2``, ``U`` resumes it on the same shape, ``V``
with ``ep_size=1``; ``P``: the path users take, ``from_pretrained`` and ``get_peft_model`` inside
``configure_model`` under ZeRO-3 ``zero.Init``, trains 2 steps and saves). The resumed runs'
models are built with other initial values (seed 1), so everything they hold after the load came
from the checkpoint. Checked against a plain single-process PEFT run (no DeepSpeed, no Lightning,
AdamW) over the batches each rank received, and against the seed-0 model's own tensors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.jobs import JOBS, REPO, free_port, job_env

sys.path.insert(0, str(JOBS))
import lora_ep_job as job  # noqa: E402

#: fp32; measured at most 9.7e-8 relative (the order of the gradient reduction).
RTOL = 2e-6
#: Exported logits against the engine's; measured ~1e-7.
ATOL = 1e-5
CHAINS = {"A": "A", "B": "AB", "C": "AC", "D": "ACD", "E": "AE", "T": "T", "U": "TU", "V": "TV"}
#: The runs with LoRA on the expert tensors too (``target_parameters``).
EXPERT_LORA = set("TUV")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_ep")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(JOBS / "lora_ep_job.py"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    return out


def _ranks(out: Path, run: str) -> list[dict]:
    return [json.loads((out / run / f"rank{r}.json").read_text()) for r in (0, 1)]


def _steps(out: Path, run: str) -> dict[int, tuple[list[list[int]], float]]:
    """step -> (each rank's sample indices, the global loss: the mean of the ranks' means)."""
    a, b = _ranks(out, run)
    return {s["step"]: ([s["indices"], t["indices"]], (s["loss"] + t["loss"]) / 2)
            for s, t in zip(a["steps"], b["steps"])}


def plain_peft_losses(batches: list[list[list[int]]], experts: bool = False) -> list[float]:
    """One process: the seed-0 PEFT model, AdamW over the trainable (LoRA) parameters; each step's
    loss is the mean of each rank's sub-batch loss, as data parallelism averages gradients."""
    return _plain_peft(batches, experts)[0]


def _plain_peft(batches: list[list[list[int]]], experts: bool) -> tuple[list[float], torch.nn.Module]:
    from lightning_zeromoe.reference.models import SyntheticLMData

    data = SyntheticLMData(num_samples=job.SAMPLES, seq_len=job.SEQ, vocab_size=job.VOCAB, seed=0).tokens
    net = job.lora_model(0, experts)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=job.LR, weight_decay=0.0)
    losses = []
    for per_rank in batches:
        loss = sum(net(input_ids=data[i], labels=data[i], use_cache=False).loss for i in per_rank) / len(per_rank)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, net


def _seed_state(seed: int, experts: bool = False) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in job.lora_model(seed, experts).named_parameters()}


def _expected(reference: dict[str, torch.Tensor], name: str, local: dict[str, list[int]]) -> torch.Tensor:
    """What a frozen parameter of the engine must hold, from the plain model's own tensors: AutoEP's
    ``w1``/``w3`` (gate, up) are the halves of Mixtral's ``gate_up_proj [E, 2*ffn, hidden]``, ``w2``
    its ``down_proj``, rows in the order of this rank's experts; its router is Mixtral's ``gate``."""
    own = name.removeprefix("net.")
    if ".experts.w" in own:
        block, w = own.rsplit(".experts.", 1)
        gate_up, down = reference[f"{block}.experts.gate_up_proj"], reference[f"{block}.experts.down_proj"]
        ffn = gate_up.shape[1] // 2
        return {"w1": gate_up[:, :ffn], "w3": gate_up[:, ffn:], "w2": down}[w][local[f"net.{block}"]]
    return reference[own.replace(".router.gate.", ".gate.")]


# ------------------------------------------------------------------ save


def test_save_writes_frozen_experts_beside_deepspeeds_shards_once_per_group(runs):
    reference = _seed_state(0)
    ckpt = runs / "A" / "ckpt" / "step=2.ckpt"
    assert (ckpt / "latest").is_file()
    manifest = json.loads((ckpt / "zeromoe_frozen_experts" / "manifest.json").read_text())
    assert manifest["ep_size"] == 2 and manifest["files"] == ["ep_rank_0.pt", "ep_rank_1.pt"]
    assert len(manifest["names"]) == 6  # w1, w2, w3 of both layers
    for r, ids in ((0, [0, 1]), (1, [2, 3])):
        saved = torch.load(ckpt / "zeromoe_frozen_experts" / f"ep_rank_{r}.pt", weights_only=True)
        assert saved["ep_rank"] == r and set(saved["module"]) == set(manifest["names"])
        for name, tensor in saved["module"].items():
            block = name.removeprefix("net.").rsplit(".experts.", 1)[0]
            assert saved["experts"]["net." + block] == ids
            assert torch.equal(tensor, _expected(reference, name, {"net." + block: ids})), name
        # DeepSpeed's shards of the same rank hold no expert weight: neither as trained nor as frozen.
        states = torch.load(ckpt / "checkpoint" / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", weights_only=False)
        held = {n for group in states["param_shapes"] for n in group} | set(states["frozen_param_shapes"])
        assert not any(".experts.w" in n for n in held)
    # Each rank wrote its own expert-parallel rank's file; with one group of 2 (E) only its first rank wrote.
    written = [r["frozen_experts_written"].rsplit("/", 1)[-1] for r in _ranks(runs, "A")]
    assert written == ["ep_rank_0.pt", "ep_rank_1.pt"]
    e_ranks = _ranks(runs, "E")
    assert e_ranks[0]["frozen_experts_written"].endswith("step=3.ckpt/zeromoe_frozen_experts/ep_rank_0.pt")
    assert e_ranks[1]["frozen_experts_written"] == "None"
    e_files = sorted(p.name for p in (runs / "E" / "ckpt" / "step=3.ckpt" / "zeromoe_frozen_experts").iterdir())
    assert e_files == ["ep_rank_0.pt", "manifest.json"]
    # Saving presented the frozen experts to DeepSpeed as trainable for a moment: nothing stayed so.
    for run in "ABCDE":
        for r in _ranks(runs, run):
            assert r["trainable_after"] == r["trainable_before"]
            assert r["trainable_before"] and all(".lora_" in n for n in r["trainable_before"])


# ------------------------------------------------------------------ training and resume


@pytest.mark.parametrize("run", list(CHAINS))
def test_losses_match_a_plain_peft_run_over_the_same_batches(runs, run):
    steps: dict[int, tuple[list[list[int]], float]] = {}
    for part in CHAINS[run]:
        steps.update(_steps(runs, part))
    order = sorted(steps)
    assert order == list(range(1, len(order) + 1))
    experts = run in EXPERT_LORA
    reference = dict(zip(order, plain_peft_losses([steps[k][0] for k in order], experts)))
    ours = _steps(runs, run)
    assert len(ours) >= 1
    gaps = {k: abs(loss - reference[k]) / abs(reference[k]) for k, (_, loss) in ours.items()}
    print(f"{run}: steps {sorted(ours)}, worst relative loss gap {max(gaps.values()):.1e}")
    assert max(gaps.values()) < RTOL, gaps
    if CHAINS[run] != run:  # a model that did not resume (trained from scratch on that batch) would be told apart
        fresh = plain_peft_losses([steps[min(ours)][0]], experts)[0]
        assert abs(fresh - reference[min(ours)]) / abs(fresh) > 100 * RTOL


@pytest.mark.parametrize("run", ["B", "C", "D", "E"])
def test_resumed_frozen_parameters_equal_the_saved_ones_bit_for_bit(runs, run):
    reference, other = _seed_state(0), _seed_state(1)
    for r in (0, 1):
        captured = torch.load(runs / run / f"frozen_rank{r}.pt", weights_only=True)
        frozen, local = captured["frozen"], captured["local_experts"]
        experts = [n for n in frozen if ".experts." in n]
        assert len(experts) == (4 if run == "C" else 6), sorted(frozen)  # C: Mixtral's own gate_up_proj/down_proj
        for name, value in frozen.items():
            own = name.removeprefix("net.")
            expected = reference[own] if own in reference else _expected(reference, name, local)
            assert torch.equal(value, expected), f"{run} rank {r}: {name}"
            # The model resumed was built with other values (all but the norms' ones): the check above can fail.
            built = other[own] if own in other else _expected(other, name, local)
            assert "norm" in name or not torch.equal(value, built), f"{run} rank {r}: {name} has its seed-1 value"
        if run in ("B", "D"):
            assert sorted(local.values()) == ([[0, 1], [0, 1]] if r == 0 else [[2, 3], [2, 3]])
        if run == "E":
            assert all(ids == [0, 1, 2, 3] for ids in local.values())


# ------------------------------------------------------------------ export


def _export(runs: Path, run: str, ckpt: str, out: Path) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``zeromoe-export`` of ``run``'s ``ckpt`` into ``out`` (a real subprocess); the engine's input ids
    and logits (equal on both ranks), and the largest gap of the merged export's logits to them."""
    from transformers import AutoModelForCausalLM

    proc = subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", str(runs / run / "ckpt" / ckpt), str(out)],
                          capture_output=True, text=True, timeout=300, env=job_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = [torch.load(runs / run / f"engine_outputs_rank{r}.pt") for r in (0, 1)]
    assert torch.allclose(engine[0]["logits"], engine[1]["logits"], atol=1e-6)
    ids, logits = engine[0]["input_ids"], engine[0]["logits"]
    merged, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    merged.eval()
    with torch.no_grad():
        return ids, logits, (merged(input_ids=ids, use_cache=False).logits - logits).abs().max().item()


def test_export_of_a_frozen_expert_checkpoint_loads_and_gives_the_trained_logits(runs, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    ids, logits, diff_merged = _export(runs, "A", "step=6.ckpt", out)
    base = _plain_seed0_model()  # the frozen base the run started from (same seed), without the adapter
    base.eval()
    with torch.no_grad():
        base_diff = (base(input_ids=ids, use_cache=False).logits - logits).abs().max().item()
    state = load_file(out / "model.safetensors")
    assert torch.equal(state["model.layers.1.mlp.experts.gate_up_proj"],
                       _seed_state(0)["base_model.model.model.layers.1.mlp.experts.gate_up_proj"])
    with_adapter = PeftModel.from_pretrained(_plain_seed0_model(), out / "adapter")
    with_adapter.eval()
    with torch.no_grad():
        diff_adapter = (with_adapter(input_ids=ids, use_cache=False).logits - logits).abs().max().item()
    print(f"export: max |merged - engine| = {diff_merged:.2e}, |base + adapter - engine| = {diff_adapter:.2e} "
          f"(untrained base: {base_diff:.2e})")
    assert diff_merged < ATOL and diff_adapter < ATOL and base_diff > 100 * ATOL
    frozen = json.loads((out / "zeromoe_export.json").read_text())["frozen"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in frozen


def _plain_seed0_model() -> torch.nn.Module:
    import lightning as L

    sys.path.insert(0, str(JOBS))
    from train_hf import build_hf_model

    L.seed_everything(0, verbose=False)
    return build_hf_model("mixtral")


def test_a_copy_without_its_frozen_experts_is_refused_by_resume_and_export(runs, tmp_path):
    from lightning_zeromoe.checkpoint import frozen_experts
    from lightning_zeromoe.checkpoint.resume.saved import read_saved
    from troubleshooter import knowledge

    copy = tmp_path / "copy"
    shutil.copytree(runs / "A" / "ckpt" / "step=2.ckpt", copy, ignore=shutil.ignore_patterns("zeromoe_frozen_experts"))
    with pytest.raises(frozen_experts.FrozenExpertsError, match=r"^\[autoep-frozen-experts\] .* no "
                                                                 r"zeromoe_frozen_experts/manifest.json") as err:
        frozen_experts.check_saved(read_saved(copy))  # what ZeroMoEStrategy.load_checkpoint runs first
    assert knowledge.match(str(err.value))[0].entry.id == "autoep-frozen-experts"
    proc = subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", str(copy), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=job_env(), cwd=REPO)
    assert proc.returncode != 0 and "[autoep-frozen-experts]" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ LoRA on the expert tensors (T, U, V)

EXPERT_TENSORS = ("experts.base_layer.base_layer.gate_up_proj", "experts.base_layer.base_layer.down_proj")


def test_blocks_with_expert_lora_fall_back_to_zero3_with_the_reason(runs):
    log = (runs / "log.txt").read_text()
    for layer in (0, 1):
        line = (f"net.base_model.model.model.layers.{layer}.mlp (MixtralSparseMoeBlock): it holds PEFT adapters "
                "(experts (ParamWrapper), experts.base_layer (ParamWrapper)), which AutoEP's layer would drop")
        assert line in log, line
    assert "0 MoE block(s) with expert parallelism; 2 without EP" in log
    for run in "TUV":
        for r in _ranks(runs, run):
            trained = r["trainable_after"]
            assert trained == r["trainable_before"] and all(".lora_" in n for n in trained)
            assert sum(".mlp.experts." in n for n in trained) == 8  # lora_A, lora_B of 2 tensors x 2 layers
            assert r["frozen_experts_written"] == "None"  # no AutoEP layer: nothing of frozen_experts' own


def test_expert_lora_trains_like_plain_peft_and_the_base_experts_stay_frozen(runs):
    steps = _steps(runs, "T")
    _, plain = _plain_peft([steps[k][0] for k in sorted(steps)], experts=True)
    plain_state = {n: p.detach() for n, p in plain.named_parameters()}
    start = _seed_state(0, experts=True)
    end = {n.removeprefix("net."): t for n, t in torch.load(runs / "T" / "params_end.pt", weights_only=True).items()}
    assert set(end) == set(start)
    expert_lora = [n for n in end if ".mlp.experts." in n and ".lora_" in n]
    assert len(expert_lora) == 8
    for name in expert_lora:  # trained: moved from its initial value (lora_B starts at zero), as plain PEFT moved it
        assert not torch.equal(end[name], start[name]), name
        assert torch.allclose(end[name], plain_state[name], rtol=1e-4, atol=1e-6), name
    frozen = [n for n, p in job.lora_model(0, True).named_parameters() if not p.requires_grad]
    assert sum(n.endswith(EXPERT_TENSORS) for n in frozen) == 4
    for name in frozen:  # experts, routers, attention bases, embeddings: bit for bit
        assert torch.equal(end[name], start[name]), name


@pytest.mark.parametrize("run", ["U", "V"])
def test_expert_lora_resume_restores_every_frozen_tensor_bit_for_bit(runs, run):
    reference, other = _seed_state(0, experts=True), _seed_state(1, experts=True)
    for r in (0, 1):
        frozen = torch.load(runs / run / f"frozen_rank{r}.pt", weights_only=True)["frozen"]
        assert sum(n.endswith(EXPERT_TENSORS) for n in frozen) == 4, sorted(frozen)
        for name, value in frozen.items():
            own = name.removeprefix("net.")
            assert torch.equal(value, reference[own]), f"{run} rank {r}: {name}"
            assert "norm" in name or not torch.equal(value, other[own]), f"{run} rank {r}: {name} has its seed-1 value"


def test_export_merges_the_expert_lora_and_gives_the_trained_logits(runs, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    ids, logits, diff_merged = _export(runs, "T", "step=4.ckpt", out)
    # The experts were merged: they are no longer the frozen base (an export that dropped the adapter would be).
    end = torch.load(runs / "T" / "params_end.pt", weights_only=True)
    state = load_file(out / "model.safetensors")
    for layer in (0, 1):
        for tensor in ("gate_up_proj", "down_proj"):
            base = end[f"net.base_model.model.model.layers.{layer}.mlp.experts.base_layer.base_layer.{tensor}"]
            assert not torch.equal(state[f"model.layers.{layer}.mlp.experts.{tensor}"], base)
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert sum(".mlp.experts." in n for n in adapter) == 8
    with_adapter = PeftModel.from_pretrained(_plain_seed0_model(), out / "adapter")
    with_adapter.eval()
    with torch.no_grad():
        diff_adapter = (with_adapter(input_ids=ids, use_cache=False).logits - logits).abs().max().item()
        with with_adapter.disable_adapter():
            base_diff = (with_adapter(input_ids=ids, use_cache=False).logits - logits).abs().max().item()
    print(f"expert LoRA export: max |merged - engine| = {diff_merged:.2e}, |base + adapter - engine| = "
          f"{diff_adapter:.2e} (adapter off: {base_diff:.2e})")
    assert diff_merged < ATOL and diff_adapter < ATOL and base_diff > 100 * ATOL


def test_export_refuses_expert_lora_it_cannot_place_rather_than_dropping_it():
    """A checkpoint whose metadata does not say which parameter each ParamWrapper adapts (saved
    before it was recorded) is refused; with it, the merge equals PEFT's ``merge_and_unload``."""
    import copy

    from lightning_zeromoe.checkpoint.errors import ExportError
    from lightning_zeromoe.checkpoint.lora import split_lora
    from lightning_zeromoe.checkpoint.plan import OutputTensor
    from lightning_zeromoe.checkpoint.save import _lora_adapters
    from troubleshooter import knowledge

    net = job.lora_model(0, True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".lora_B." in name:  # PEFT starts lora_B at zero: give the adapter a delta to merge
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    adapters = _lora_adapters(net)
    prefix = adapters[0].peft_prefix
    outputs = [OutputTensor(n.removeprefix(prefix), tuple(p.shape), lambda reader, t=p.detach().clone(): t)
               for n, p in net.named_parameters()]
    merged, _ = split_lora(outputs, adapters)
    expected = copy.deepcopy(net).merge_and_unload().state_dict()
    got = {o.name: o.build(None) for o in merged}
    assert set(got) == set(expected)
    assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in expected)
    assert not torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"],
                           net.get_parameter(f"{prefix}model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"))
    adapters[0].param_wrappers = {}
    with pytest.raises(ExportError, match=r"^\[export-unsupported-model\] .*model\.layers\.0\.mlp\.experts") as err:
        split_lora(outputs, adapters)
    assert knowledge.match(str(err.value))[0].entry.id == "export-unsupported-model"


# ------------------------------------------------------------------ from_pretrained + get_peft_model in configure_model


def test_peft_wrapped_inside_configure_model_starts_and_trains_like_plain_peft(runs):
    """Run ``P``: PEFT's LoRA initialisation under ``zero.Init`` was a no-op on partitioned tensors
    (``lora_B`` kept ``nn.Linear``'s random values, so training started from another model: first
    loss off by 5e-4); now the LoRA weights start bit for bit as plain PEFT draws them."""
    path = runs / "P" / "pretrained"
    start = torch.load(runs / "P" / "lora_start.pt", weights_only=True)
    plain = job.pretrained_lora_model(path)
    expected = {n: p.detach() for n, p in plain.named_parameters() if p.requires_grad}
    assert sorted(n.removeprefix("net.") for n in start) == sorted(expected) and len(start) == 8
    for name, value in start.items():
        assert torch.equal(value, expected[name.removeprefix("net.")]), name
    assert all(not value.any() for name, value in start.items() if ".lora_B." in name)
    assert all(value.abs().max() > 0.05 for name, value in start.items() if ".lora_A." in name)
    steps = _steps(runs, "P")
    assert sorted(steps) == [1, 2]
    from lightning_zeromoe.reference.models import SyntheticLMData

    data = SyntheticLMData(num_samples=job.SAMPLES, seq_len=job.SEQ, vocab_size=job.VOCAB, seed=0).tokens
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=job.LR, weight_decay=0.0)
    for step in sorted(steps):
        per_rank, ours = steps[step]
        loss = sum(plain(input_ids=data[i], labels=data[i], use_cache=False).loss for i in per_rank) / len(per_rank)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"P step {step}: relative loss gap {abs(ours - loss.item()) / loss.item():.1e}")
        assert abs(ours - loss.item()) / loss.item() < RTOL, (step, ours, loss.item())


def test_export_of_the_pretrained_peft_run_gives_the_engines_logits(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", str(runs / "P" / "ckpt" / "step=2.ckpt"),
                           str(out)], capture_output=True, text=True, timeout=300, env=job_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = torch.load(runs / "P" / "engine_outputs_rank0.pt", weights_only=True)
    merged, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    base = AutoModelForCausalLM.from_pretrained(runs / "P" / "pretrained")
    with torch.no_grad():
        logits = merged(input_ids=engine["input_ids"], use_cache=False).logits
        untrained = base(input_ids=engine["input_ids"], use_cache=False).logits
    assert torch.allclose(logits, engine["logits"], atol=ATOL), (logits - engine["logits"]).abs().max()
    assert (untrained - engine["logits"]).abs().max() > 100 * ATOL  # the adapter is in the merged model
