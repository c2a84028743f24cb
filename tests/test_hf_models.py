"""Hugging Face MoE models under ZeroMoEStrategy: discovery, AutoEP's own detection, and training.

Three layers of evidence, cheapest first:

1. ``discover`` (pure, in-process) for every AutoEP preset whose HF class the installed
   transformers has: the tiny model is put in a LightningModule under some attribute name and
   the discovered section must name the real MoE blocks (the decoder layers that the *config*
   makes sparse, written down here independently of the module tree), the preset, the expert
   count and top_k.
2. DeepSpeed's AutoEP parser itself (``AutoEP(root, cfg).ep_parser()``), run on the
   LightningModule root with the discovered section and the HF config lent by the strategy's
   ``lend_root_config``: it must detect exactly the blocks, with exactly the routing details,
   that it detects when pointed at the bare HF model the way AutoEP is normally used. Negative
   controls show the same parser finds nothing without the re-rooted pattern and fails without
   the lent config, so agreement is not an accident. No processes are needed for any of this.
3. A real training (``tests/jobs/train_hf.py``, Mixtral, 2 CPU ranks, ZeRO-3,
   EP=2, 5 steps) run as subprocesses, because Lightning starts the second rank by re-running a
   script. Its per-rank JSON is checked for converted blocks, the experts each rank actually
   holds, finite and falling losses, and HF's router logits / aux loss after AutoEP's replacement.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import lightning as L
import transformers
from deepspeed.module_inject.auto_ep import AutoEP  # noqa: E402
from deepspeed.module_inject.auto_ep_config import parse_autoep_config  # noqa: E402

from support.jobs import JOBS, job_env  # noqa: E402  (tests/ is on sys.path via conftest.py)
from lightning_zeromoe.discovery.find import discover  # noqa: E402
from lightning_zeromoe.engine.build import lend_root_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOB = JOBS / "train_hf.py"
JOB_TIMEOUT_S = 240

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2)


@dataclass(frozen=True)
class Family:
    """A tiny model of one AutoEP preset, and which of its decoder layers the config makes MoE."""

    preset: str
    config_cls: str
    causal_lm_cls: str
    base_model_cls: str
    config: dict[str, Any]
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...] = ()
    num_experts: int = 4
    top_k: int = 2

    def classes(self) -> tuple[type, type, type]:
        names = (self.config_cls, self.causal_lm_cls, self.base_model_cls)
        found = [getattr(transformers, name, None) for name in names]
        missing = [name for name, cls in zip(names, found) if cls is None]
        if missing:
            pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)} "
                        f"(needed for AutoEP preset '{self.preset}')")
        return tuple(found)  # type: ignore[return-value]

    def build(self, base: bool = False) -> Any:
        config_cls, causal_lm_cls, base_cls = self.classes()
        return (base_cls if base else causal_lm_cls)(config_cls(**self.config))


_DEEPSEEK = dict(COMMON, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                 n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)

#: One entry per AutoEP preset in deepspeed 0.19.8. moe_layers/dense_layers follow from the
#: config written next to them (first_k_dense_replace, mlp_only_layers, mlp_layer_types), so the
#: expected block names do not come from the code under test.
FAMILIES = {
    "mixtral": Family("mixtral", "MixtralConfig", "MixtralForCausalLM", "MixtralModel",
                      dict(COMMON, num_hidden_layers=2, num_local_experts=4), moe_layers=(0, 1)),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeModel",
                        dict(COMMON, num_hidden_layers=3, num_experts=4, moe_intermediate_size=32, head_dim=16,
                             mlp_only_layers=[0]), moe_layers=(1, 2), dense_layers=(0,)),
    "qwen3_5_moe": Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel",
                          dict(COMMON, num_hidden_layers=2, num_experts=4, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, head_dim=16), moe_layers=(0, 1)),
    "deepseek_v2": Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Model",
                          _DEEPSEEK, moe_layers=(1, 2), dense_layers=(0,)),
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3Model",
                          dict(_DEEPSEEK, n_group=2, topk_group=1), moe_layers=(1, 2), dense_layers=(0,)),
    "minimax_m3": Family("minimax_m3", "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", "MiniMaxM3VLTextModel",
                         dict(COMMON, num_hidden_layers=3, head_dim=16, num_local_experts=4,
                              dense_intermediate_size=64, shared_intermediate_size=32, index_head_dim=16,
                              mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=None, eos_token_id=None),
                         moe_layers=(1, 2), dense_layers=(0,)),
}


def _holder(attr: str, model: Any) -> Any:
    """A LightningModule that holds ``model`` under ``attr`` (not the default ``model``)."""

    class Holder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, attr, model)

    return Holder()


def _autoep_specs(root: Any, section: dict[str, Any], lend: Any = None) -> list[Any]:
    """DeepSpeed's AutoEP parser on ``root`` with an ``expert_parallel`` section, as initialize runs it."""
    cfg = parse_autoep_config({"enabled": True, "autoep_size": 2, **section})
    with lend_root_config(root, lend):
        return AutoEP(root, cfg).ep_parser()


def _comparable(spec: Any, strip: str = "") -> dict[str, Any]:
    """A spec as a dict with its module name made relative to the HF model, for comparison."""
    out = dataclasses.asdict(spec)
    assert out["moe_module_name"].startswith(strip)
    out["moe_module_name"] = out["moe_module_name"][len(strip):]
    return out


# --------------------------------------------------------------------------- 1 + 2: per preset


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_discover_finds_exactly_the_moe_blocks_and_autoep_agrees(preset: str) -> None:
    """Discovery under an arbitrary attribute name, then AutoEP's own parser on the Lightning root."""
    fam = FAMILIES[preset]
    model = fam.build()
    root = _holder("student", model)

    found = discover(root)

    moe = {f"student.model.layers.{i}.mlp" for i in fam.moe_layers}
    dense = {f"student.model.layers.{i}.mlp" for i in fam.dense_layers}
    assert found.source == f"hf:{preset}"
    assert found.autoep["preset_model"] == preset
    assert found.root_config is model.config
    assert {b.path for b in found.blocks} == moe and len(found.blocks) == len(fam.moe_layers)
    assert all(b.num_experts == fam.num_experts and b.top_k == fam.top_k for b in found.blocks)

    # The pattern is the preset's, re-rooted: it matches every MoE block, and beyond them only
    # the dense FFNs at the same position (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers,
    # MiniMax's "dense" layers), which AutoEP skips because they have no experts child.
    pattern = re.compile(found.autoep["moe_layer_pattern"])
    matched = {name for name, _ in root.named_modules() if pattern.fullmatch(name)}
    assert matched == moe | dense
    modules = dict(root.named_modules())
    assert all(not hasattr(modules[name], "experts") for name in dense)

    specs = _autoep_specs(root, found.autoep, lend=found.root_config)
    assert "config" not in root.__dict__, "lend_root_config must give the root back without .config"
    assert {s.moe_module_name for s in specs} == moe
    assert all(s.model_family == preset and s.num_experts == fam.num_experts and s.top_k == fam.top_k for s in specs)

    # The bridge changes nothing AutoEP decides: the bare HF model, as AutoEP is normally used
    # (preset only, model.config on the root), gives the same specs field for field.
    native = _autoep_specs(model, {"preset_model": preset})
    assert sorted((_comparable(s, "student.") for s in specs), key=lambda s: s["moe_module_name"]) == \
        sorted((_comparable(s) for s in native), key=lambda s: s["moe_module_name"])


@pytest.mark.parametrize("preset", ["mixtral", "deepseek_v3"])
def test_discover_hf_base_model_without_model_level(preset: str) -> None:
    """A base model (``MixtralModel``) has no ``.model`` level: its blocks are ``layers.N.mlp``."""
    fam = FAMILIES[preset]
    base = fam.build(base=True)
    root = _holder("encoder", base)

    found = discover(root)

    moe = {f"encoder.layers.{i}.mlp" for i in fam.moe_layers}
    assert found.source == f"hf:{preset}"
    assert found.autoep["moe_layer_pattern"] == r"encoder\.layers\.\d+\.mlp"
    assert {b.path for b in found.blocks} == moe
    specs = _autoep_specs(root, found.autoep, lend=found.root_config)
    assert {s.moe_module_name for s in specs} == moe


def test_discover_hf_model_as_root() -> None:
    """The HF model itself as the root: the preset's own pattern already fits, nothing is overridden."""
    fam = FAMILIES["mixtral"]
    model = fam.build()

    found = discover(model)

    assert found.autoep == {"preset_model": "mixtral"}
    assert {b.path for b in found.blocks} == {f"model.layers.{i}.mlp" for i in fam.moe_layers}
    assert {s.moe_module_name for s in _autoep_specs(model, found.autoep, lend=found.root_config)} == \
        {b.path for b in found.blocks}


def test_discover_lightning_module_that_is_the_hf_model() -> None:
    """A LightningModule that *is* the HF model (``class Lit(MixtralForCausalLM, LightningModule)``)."""
    fam = FAMILIES["mixtral"]
    config_cls, causal_lm_cls, _ = fam.classes()

    class LitMixtral(causal_lm_cls, L.LightningModule):  # type: ignore[misc, valid-type]
        pass

    root = LitMixtral(config_cls(**fam.config))
    found = discover(root)

    assert found.autoep == {"preset_model": "mixtral"} and found.root_config is root.config
    expected = {f"model.layers.{i}.mlp" for i in fam.moe_layers}
    assert {b.path for b in found.blocks} == expected
    assert {s.moe_module_name for s in _autoep_specs(root, found.autoep, lend=found.root_config)} == expected
    assert root.config is found.root_config, "lending must restore the model's own config"


def test_discover_sees_past_a_lightning_module_that_keeps_the_hf_config() -> None:
    """The common ``self.config = config; self.model = MixtralForCausalLM(config)`` LightningModule:
    the root carries an HF config too, but the blocks live under ``model``. Discovery must root
    the pattern at the HF model, not at the LightningModule whose config it happens to share."""
    fam = FAMILIES["mixtral"]
    config_cls, causal_lm_cls, _ = fam.classes()

    class Lit(L.LightningModule):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            self.model = causal_lm_cls(config)

    root = Lit(config_cls(**fam.config))
    found = discover(root)

    expected = {f"model.model.layers.{i}.mlp" for i in fam.moe_layers}
    assert found.autoep["moe_layer_pattern"] == r"model\.model\.layers\.\d+\.mlp"
    assert {b.path for b in found.blocks} == expected
    assert {s.moe_module_name for s in _autoep_specs(root, found.autoep, lend=found.root_config)} == expected
    assert root.config is root.model.config, "lending must put the module's own config back"


def test_discover_refuses_two_hf_moe_models() -> None:
    """AutoEP converts one model family per engine; two MoE models (teacher and student) are
    ambiguous, and the error names both paths."""
    fam = FAMILIES["mixtral"]

    class TwoModels(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = fam.build()
            self.student = fam.build()

    with pytest.raises(ValueError, match=r"several Hugging Face MoE models \(teacher \(mixtral\), student"):
        discover(TwoModels())


def test_discover_descends_from_composite_vlm_to_text_backbone() -> None:
    """Qwen3.5-MoE's composite VLM config (model_type ``qwen3_5_moe``) is refused by AutoEP's
    preset; its text backbone (``qwen3_5_moe_text``) is what the preset converts. Discovery must
    root the pattern at the backbone and lend the backbone's config, not the composite one."""
    cls = getattr(transformers, "Qwen3_5MoeForConditionalGeneration", None)
    config_cls = getattr(transformers, "Qwen3_5MoeConfig", None)
    if cls is None or config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3_5MoeForConditionalGeneration")
    text = {k: v for k, v in FAMILIES["qwen3_5_moe"].config.items()}
    vlm = cls(config_cls(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                               num_heads=2, out_hidden_size=64)))
    root = _holder("vlm", vlm)

    found = discover(root)

    expected = {f"vlm.model.language_model.layers.{i}.mlp" for i in (0, 1)}
    assert found.source == "hf:qwen3_5_moe"
    assert found.root_config.model_type == "qwen3_5_moe_text"
    assert {b.path for b in found.blocks} == expected
    assert {s.moe_module_name for s in _autoep_specs(root, found.autoep, lend=found.root_config)} == expected


def test_autoep_needs_both_halves_of_the_bridge() -> None:
    """Negative controls: AutoEP on a LightningModule root fails without the re-rooted pattern
    (``no MoE layers detected``) and without the lent config (``Could not determine top_k``).
    These are the two failures the field notes record; the tests above pass only because the
    strategy supplies both."""
    fam = FAMILIES["mixtral"]
    model = fam.build()
    root = _holder("net", model)
    found = discover(root)

    with pytest.raises(ValueError, match="no MoE layers detected"):
        _autoep_specs(root, {"preset_model": "mixtral"}, lend=model.config)
    with pytest.raises(ValueError, match="Could not determine top_k"):
        _autoep_specs(root, found.autoep, lend=None)


# --------------------------------------------------------------------------- 3: real training


def _run_job(family: str, out: Path, timeout: int = JOB_TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float]:
    # The shared job environment (one OMP thread per rank on two cores), minus any launcher
    # variables inherited from an outer torchrun, which would make Lightning join that world.
    env = {k: v for k, v in job_env().items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONUNBUFFERED"] = "1"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(JOB), "--family", family, "--out", str(out),
                           "--devices", "2", "--ep-size", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module", params=["mixtral"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 5-step training run, shared by the assertions below. Mixtral only: Qwen3-MoE (and every
    other type) trains in the zoo launch of ``tests/test_hf_coverage.py``, at parity with HF's own
    loss and aux loss and with as many router logits as the plain run (a second launch here cost ~30 s)."""
    family = request.param
    out = tmp_path_factory.mktemp(f"hf_{family}")
    proc, wall = _run_job(family, out)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{family} job exited {proc.returncode} after {wall:.0f}s:\n{tail}"
    ranks = {}
    for path in sorted(out.glob("rank*.json")):
        data = json.loads(path.read_text())
        ranks[data["rank"]] = data
    assert sorted(ranks) == [0, 1], f"expected rank0.json and rank1.json in {out}, got {sorted(ranks)}:\n{tail}"
    print(f"{family}: job wall {wall:.1f}s, fit {[ranks[r]['fit_seconds'] for r in (0, 1)]}s")
    return {"family": family, "ranks": ranks, "wall": wall, "log": proc.stdout + proc.stderr}


EXPECTED_BLOCKS = {"net.model.layers.0.mlp", "net.model.layers.1.mlp"}


def test_training_converts_every_moe_block(trained: dict[str, Any]) -> None:
    for r, data in trained["ranks"].items():
        assert data["discovery"]["source"] == f"hf:{trained['family']}"
        assert set(data["blocks"]) == EXPECTED_BLOCKS, f"rank {r}: discovered {sorted(data['blocks'])}"
        assert set(data["blocks"].values()) == {"AutoEPMoELayer"}, f"rank {r}: {data['blocks']}"
        assert set(data["autoep_layers"]) == EXPECTED_BLOCKS, f"rank {r}: extra/missing AutoEP layers"
        assert data["root_config_restored"], f"rank {r}: the lent HF config was left on the LightningModule"


def test_training_log_has_no_autoep_preset_warning(trained: dict[str, Any]) -> None:
    """DeepSpeed warned "Custom preset fields ['moe_layer_pattern'] are set alongside preset_model=..."
    twice per rank here before the strategy left preset_model out of what it sends (autoep_wire.py;
    ``test_autoep_wire.py`` draws the warning from DeepSpeed's own check with the old section).
    The control: DeepSpeed's logger does reach this log, at the level that warning has (on a
    machine without a GPU it warns at import that it set the accelerator to CPU)."""
    import torch

    if not torch.cuda.is_available():
        assert "[WARNING] [real_accelerator.py" in trained["log"], trained["log"][-2000:]
    assert "Custom preset fields" not in trained["log"]


def test_training_each_rank_holds_half_the_experts(trained: dict[str, Any]) -> None:
    """From the live parameters: expert tensors hold num_experts / ep_size experts per rank, the
    two ranks hold different experts (matched against the original weights), and ZeRO-3 shards
    the dense parameters over both ranks."""
    ranks = trained["ranks"]
    for r, data in ranks.items():
        world, ep = data["world_size"], data["ep_size"]
        local = 4 // ep
        assert data["expert_params"], f"rank {r}: no expert parameters recorded"
        for name, p in data["expert_params"].items():
            assert p["ds_shape"][0] == local, f"rank {r}: {name} ds_shape {p['ds_shape']}"
            # Experts are replicated only over world/ep ranks (1 here), so each rank stores them whole.
            assert p["partition_numel"] == math.ceil(p["ds_numel"] / (world // ep)), f"rank {r}: {name} {p}"
        for name, p in data["dense_params"].items():
            assert p["partition_numel"] == math.ceil(p["ds_numel"] / world), f"rank {r}: {name} not sharded: {p}"
        for block, layer in data["autoep_layers"].items():
            assert (layer["num_experts"], layer["num_local_experts"], layer["ep_size"]) == (4, local, ep)
    for block in EXPECTED_BLOCKS:
        held = [ranks[r]["local_expert_ids"][block] for r in (0, 1)]
        assert all(len(ids) == 2 and None not in ids for ids in held), f"{block}: {held}"
        assert sorted(held[0] + held[1]) == [0, 1, 2, 3], f"{block}: ranks hold {held}"


def test_training_losses_finite_and_falling(trained: dict[str, Any]) -> None:
    ranks = trained["ranks"]
    for r, data in ranks.items():
        losses = data["losses"]
        assert data["steps_run"] == data["global_step"] == 5 == len(losses), f"rank {r}: {data['global_step']}"
        assert all(math.isfinite(x) for x in losses), f"rank {r}: {losses}"
        # Loosely: the last step is below the first, and no step rises far above it.
        assert losses[-1] < losses[0] and max(losses) <= losses[0] + 0.05, f"rank {r}: {losses}"
    assert ranks[0]["global_step"] == ranks[1]["global_step"]
    # Data parallel: the ranks trained on different sequences.
    assert not set(ranks[0]["steps"][0]["batch_indices"]) & set(ranks[1]["steps"][0]["batch_indices"])


def test_training_hf_router_logits_and_aux_loss_survive_autoep(trained: dict[str, Any]) -> None:
    """HF's output recorders, retargeted by AutoEP, return AutoEP's own router logits, one per
    MoE layer with all 4 experts' columns, and ``out.aux_loss`` is computed from them."""
    for r, data in trained["ranks"].items():
        for step in data["steps"]:
            where = f"rank {r} step {step['step']}"
            assert step["router_logits_captured"], f"{where}: HF returned no router_logits after AutoEP"
            assert step["num_router_logits"] == len(EXPECTED_BLOCKS) == step["autoep_router_calls"], where
            assert all(shape[-1] == 4 for shape in step["router_logits_shapes"]), f"{where}: {step}"
            assert step["router_logits_are_autoep_router_outputs"], f"{where}: captured logits are not AutoEP's"
            # Raw logits, as HF's load_balancing_loss_func expects (it applies the softmax itself).
            assert step["router_logits_kind"] == ["raw"] * len(EXPECTED_BLOCKS), f"{where}: {step['router_logits_kind']}"
            assert step["aux_loss"] is not None and math.isfinite(step["aux_loss"]) and step["aux_loss"] > 0, where
            assert step["loss"] > step["lm_loss"], f"{where}: aux term missing from the total loss"
