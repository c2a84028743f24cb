"""Hand-written MoE blocks: a router ``nn.Linear(hidden, E)`` next to ``nn.ModuleList`` of E expert MLPs.

In-process: discovery finds them whatever the names, reads each expert's roles and activation and
the block's routing off the modules themselves (not their names), says why a block cannot be
converted, does not mistake other module lists for experts, and the "no block converts" warning
is one message for every kind of model; the expert name mapping for export and resume.

One 2-rank launch (``tests/jobs/expert_list_job.py``, ~1 min on 2 CPU cores) with the three block
shapes of ``tests/support/expert_list_models.py``, routers skewed so the ranks route to disjoint experts:
``ep_size=1`` (each block a ZeRO-3 leaf module: no collective mismatch), ``ep_size=2`` (two shapes
converted by AutoEP, the Switch-style one falling back with its reason), each at parity with a
plain single-process run over the batches each rank received; the converted runs saved, exported
under the model's own names (``experts.{i}.gate_proj.weight``) and resumed: EP 2 -> 1, 1 -> 2, 2 -> 2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from support.expert_list_models import BLOCKS, HandMoELM, Top2MLP
from support.jobs import JOBS, REPO, free_port, job_env
from lightning_zeromoe.checkpoint.autoep_names import BlockNames, fuse_experts, own_expert_names, split_experts
from lightning_zeromoe.discovery.find import MoEPattern, discover
from lightning_zeromoe.discovery.result import FallbackBlock
from lightning_zeromoe.discovery.expert_list import find_expert_list, identify_mlp
from lightning_zeromoe.discovery.structure import find_blocks
from troubleshooter import knowledge

#: Relative per-step loss gap allowed against the plain run (the project's parity bound).
PARITY = 2e-6
PATHS = ["net.layers.0.moe", "net.layers.1.moe"]


# --------------------------------------------------------------------------- discovery, in-process


@pytest.mark.parametrize("kind, names, routing, returns_tuple", [
    ("topk_softmax", ("router", "experts", "gate_proj", "down_proj", "up_proj"), ("softmax", True, 1.0, 2), False),
    ("legacy_mixtral", ("gate", "experts", "w1", "w2", "w3"), ("softmax", True, 1.0, 2), True),
    ("sigmoid", ("gating", "experts", "w13", "w2", None), ("sigmoid", False, 2.5, 2), False),
    ("no_norm", ("wg", "mlps", "w1", "w2", "w3"), ("softmax", False, 1.0, 2), False),
])
def test_hand_written_blocks_are_found_and_read(kind, names, routing, returns_tuple):
    found = discover(HandMoELM(kind))
    assert found.source == "structure" and not found.fallback, found.fallback
    assert [b.path for b in found.blocks] == ["layers.0.moe", "layers.1.moe"]
    for block in found.blocks:
        lay = block.layout
        assert lay.storage == "module_list" and lay.num_experts == 4 and lay.hidden_size == 16
        assert (lay.router, lay.experts, lay.w1, lay.w2, lay.w3) == names
        r = block.routing
        assert (r.score_func, r.route_norm, r.route_scale, r.top_k) == routing
        assert block.returns_tuple is returns_tuple
    section = found.autoep
    assert section["moe_layer_pattern"] == r"layers\.0\.moe|layers\.1\.moe"
    assert (section["router_pattern"], section["expert_pattern"], section["expert_w1"], section["expert_w2"],
            section["expert_w3"]) == names
    assert (section["score_func"], section["route_norm"], section["routed_scaling_factor"], section["top_k"]) == routing


class RouterModule(nn.Module):
    """A router module around its projection (``router.proj``), returning probabilities."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x), dim=-1)


class NestedRouterMoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = RouterModule(hidden, num_experts)
        self.experts = nn.ModuleList(Top2MLP(hidden, ffn) for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(flat), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


def _nested() -> HandMoELM:
    net = HandMoELM("topk_softmax")
    torch.manual_seed(3)
    for layer in net.layers:
        layer.moe = NestedRouterMoE(16, 24, 4, 2)
    return net


def test_a_router_module_around_its_projection_is_found():
    found = discover(_nested())
    assert [b.path for b in found.blocks] == ["layers.0.moe", "layers.1.moe"] and not found.fallback
    lay = found.blocks[0].layout
    assert (lay.router, lay.router_weight, lay.router_linear) == ("router", "router.proj.weight", "router.proj")
    assert found.autoep["router_pattern"] == "zeromoe_router"  # AutoEP reads a direct child: the alias
    assert (found.blocks[0].routing.score_func, found.blocks[0].routing.route_norm) == ("softmax", True)


@pytest.mark.parametrize("make", [lambda: HandMoELM("topk_softmax"), lambda: HandMoELM("legacy_mixtral"),
                                  lambda: HandMoELM("sigmoid"), lambda: HandMoELM("no_norm"), _nested],
                         ids=["topk_softmax", "legacy_mixtral", "sigmoid_w13", "no_norm", "nested_router"])
def test_the_conversion_probe_proves_what_was_read(make):
    """The setup-time probe builds AutoEP's layer from the section read off the block (module-list
    storage: AutoEP stacks the experts) and compares forward and backward: it must agree."""
    from lightning_zeromoe.conversion.check import check_conversion

    net = make()
    found, checks = check_conversion(net, discover(net))
    assert [c.path for c in checks] == ["layers.0.moe", "layers.1.moe"]
    assert all(c.passed for c in checks), [c.detail for c in checks]
    assert [b.path for b in found.blocks] == ["layers.0.moe", "layers.1.moe"]


def test_top_k_is_found_without_an_attribute_naming_it():
    block = HandMoELM("no_norm").layers[0].moe
    assert not any(hasattr(block, a) for a in ("top_k", "k", "topk", "num_experts_per_tok"))
    [b] = [b for b in discover(HandMoELM("no_norm", top_k=3)).blocks if b.path == "layers.0.moe"]
    assert b.top_k == 3 and b.routing.route_norm is False
    assert "read off the block's forward" in b.routing.describe()


class LyingNames(nn.Module):
    """An expert whose names lie: ``up_proj`` goes through the activation, ``gate_proj`` does not."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
        self.down_proj = nn.Linear(12, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.gelu(self.up_proj(x), approximate="tanh") * self.gate_proj(x))


def test_expert_roles_and_activation_are_read_off_the_numbers_not_the_names():
    block = nn.Module()
    block.router = nn.Linear(8, 3, bias=False)
    block.experts = nn.ModuleList(LyingNames() for _ in range(3))
    listed = find_expert_list(block)
    assert listed is not None and listed.guess_roles() == ("gate_proj", "down_proj", "up_proj")
    mlp = identify_mlp(block.experts[0], listed)
    assert (mlp.w1, mlp.w2, mlp.w3, mlp.activation, mlp.unsupported) == ("up_proj", "down_proj", "gate_proj",
                                                                         "geglu_tanh", None)


@pytest.mark.parametrize("kind, reason", [
    ("switch", r"its experts are not gated \(fc1 -> gelu -> fc2\).*their Linear layers have biases \(fc1, fc2\)"),
    ("noisy", r"random in training mode"),
    ("stash", r"stores aux_loss on itself during forward"),
    ("capacity", r"not a top-k mixture of its experts.*token dropping, capacity limits"),
])
def test_blocks_autoep_would_get_wrong_fall_back_with_their_reason(kind, reason):
    found = discover(HandMoELM(kind))
    assert not found.blocks and not found.autoep
    assert [b.path for b in found.fallback] == ["layers.0.moe", "layers.1.moe"]
    for block in found.fallback:
        assert re.search(reason, block.reason), block.reason


def test_blocks_are_read_in_training_mode_whatever_mode_the_model_is_in():
    net = HandMoELM("noisy").eval()  # noise only in training: an eval-mode reading would miss it
    found = discover(net)
    assert not found.blocks and all("random in training mode" in b.reason for b in found.fallback)
    assert not any(m.training for m in net.modules())  # modes put back


class Counting(BLOCKS["topk_softmax"]):
    """Counts the tokens it routes to each expert in a buffer, as load-balancing code does."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.register_buffer("tokens_seen", torch.zeros(len(self.experts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.topk(self.router(x.reshape(-1, x.shape[-1])), self.top_k, dim=-1).indices
        self.tokens_seen += torch.bincount(chosen.flatten(), minlength=len(self.experts)).float()
        return super().forward(x)


def test_reading_a_block_leaves_its_buffers_and_the_global_rng_alone():
    block = Counting(16, 24, 4, 2)
    block(torch.randn(1, 3, 16))
    assert block.tokens_seen.sum() == 6  # the buffer really counts
    seen = block.tokens_seen.clone()
    net = HandMoELM("topk_softmax")
    net.layers[0].moe = block
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    found = discover(net)
    assert [b.path for b in found.blocks] == ["layers.0.moe", "layers.1.moe"]
    assert torch.equal(block.tokens_seen, seen)  # put back after the probe's forward passes
    assert torch.equal(torch.rand(3), want)  # the probes draw from their own generators


def test_other_module_lists_are_not_experts():
    class Heads(nn.Module):  # a list of heads next to a projection of as many outputs: no MoE
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)
            self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    class Decoder(nn.Module):  # decoder layers are not expert MLPs, whatever their count
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(16, 2)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(2))

    assert find_blocks(Heads()) == [] and find_blocks(Decoder()) == []
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    tiny = discover(TinyMoELM(TinyMoEConfig()))
    assert tiny.source == "self-described" and all(b.layout.storage == "fused_3d" for b in tiny.blocks)


def test_a_pattern_over_a_module_list_keeps_the_stated_roles():
    found = discover(HandMoELM("legacy_mixtral"), MoEPattern(block=r"layers\.\d+\.moe", top_k=2, router="gate",
                                                            w1="w1", w2="w2", w3="w3"))
    assert found.source == "pattern"
    assert [(b.layout.storage, b.layout.w1, b.layout.w3) for b in found.blocks] == [("module_list", "w1", "w3")] * 2


def test_no_expert_parallel_warning_is_one_rule_for_every_kind_of_model():
    """Hand-written (Switch-style), Hugging Face (GPT-OSS: expert biases) and MoEPattern blocks that
    all fail: the same message, naming each block and its reason, recognised by the knowledge base."""
    from support.hf_zoo import build

    hand = discover(HandMoELM("switch"))
    hf = discover(build("gpt_oss"))
    pattern = discover(HandMoELM("topk_softmax"), MoEPattern(block=r"layers\.\d+\.moe", router="router", top_k=2,
                                                            w1="gate_proj", w2="down_proj", w3="up_proj"))
    pattern = pattern.without({b.path: "the conversion probe failed (output differs by 0.5)" for b in pattern.blocks})
    shape = re.compile(r"^\[moe-no-expert-parallel\] ep_size=2, but none of the 2 MoE block\(s\) found \(source: "
                       r"(?P<source>[^)]+)\) can be converted to expert parallelism; they train under ZeRO without it, "
                       r"and 2 of them are registered as ZeRO-3 leaf modules")
    for found, source, reason in ((hand, "structure", "not gated"), (hf, "hf:custom:gpt_oss", "biases"),
                                  (pattern, "pattern", "conversion probe failed")):
        assert found.no_ep_warning(1, []) is None  # ep_size=1 asks for no expert parallelism
        message = found.no_ep_warning(2, [b.path for b in found.fallback])
        assert shape.match(message).group("source") == source, message
        for block in found.fallback:
            assert f"\n  {block.path} ({block.block_class}): {block.reason}" in message and reason in block.reason
        assert knowledge.match(message)[0].entry.id == "moe-no-expert-parallel"
    converted = discover(HandMoELM("topk_softmax"))
    assert converted.no_ep_warning(2, []) is None  # some block converts: the summary line says the rest
    partly = converted.without({"layers.1.moe": "x"})
    assert partly.no_ep_warning(2, []) is None and isinstance(partly.fallback[0], FallbackBlock)


@pytest.mark.parametrize("w3", ["up_proj", None])
def test_per_expert_names_round_trip(w3):
    names = BlockNames(router="gate", experts="experts", w1="w13" if w3 is None else "gate_proj", w2="down_proj",
                       w3=w3, storage="module_list")
    gen = torch.Generator().manual_seed(0)
    w1, w3t, w2 = (torch.randn(4, 6, 5, generator=gen), torch.randn(4, 6, 5, generator=gen),
                   torch.randn(4, 5, 6, generator=gen))
    own = fuse_experts(w1, w2, w3t, names, {})
    assert sorted(own) == sorted(own_expert_names(names, 4))
    assert own["2.down_proj.weight"].shape == (5, 6)
    back = split_experts(own, names)
    assert torch.equal(back["w1"], w1) and torch.equal(back["w2"], w2) and torch.equal(back["w3"], w3t)
    expert = Top2MLP(5, 6)  # the per-expert tensors are what an nn.Linear holds: [out, in]
    assert own["0.down_proj.weight"].shape == expert.w2.weight.shape


# --------------------------------------------------------------------------- 2 ranks, one launch

RUNS = ["topk_softmax:1", "legacy_mixtral:1", "switch:1", "topk_softmax:2", "legacy_mixtral:2", "switch:2"]
#: Saved runs resumed in a new job with other initial weights, on another shape and on the same one.
RESUME = {"topk_softmax:2": 1, "legacy_mixtral:1": 2, "legacy_mixtral:2": 2}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("expert_list")
    env = {k: v for k, v in job_env().items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(JOBS / "expert_list_job.py"), "--out", str(out), "--runs", *RUNS,
           "--save", "topk_softmax:2", "legacy_mixtral:2", "legacy_mixtral:1",
           "--resume", *(f"{spec}={ep}" for spec, ep in RESUME.items())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    results = json.loads((out / "expert_list.json").read_text())
    errors = {k: r["error"] + "\n" + r.get("trace", "") for k, r in results.items() if "error" in r}
    assert not errors, errors
    return results


def _gaps(result: dict[str, Any]) -> list[float]:
    """Relative loss gap (and aux-loss gap) of every step of every rank, resumed steps included."""
    gaps = []
    for rank, mine in enumerate(result["per_rank_records"]):
        got = mine["records"] + (mine["resumed_records"] or [])
        want = result["reference"][rank]
        assert len(got) == len(want) >= 3
        for g, w in zip(got, want):
            gaps.append(abs(g["loss"] - w["loss"]) / abs(w["loss"]))
            assert (g["aux"] is None) == (w["aux"] is None)
            if w["aux"] is not None:
                gaps.append(abs(g["aux"] - w["aux"]) / abs(w["aux"]))
    return gaps


def _disjoint_routing(result: dict[str, Any]) -> None:
    """Rank 0 sent tokens only to experts 2-3, rank 1 only to experts 0-1, in every layer."""
    rank0, rank1 = (r["expert_tokens"] for r in result["per_rank_records"])
    for layer in ("layers.0", "layers.1"):
        assert rank0[layer][:2] == [0, 0] and min(rank0[layer][2:]) > 0, rank0
        assert rank1[layer][2:] == [0, 0] and min(rank1[layer][:2]) > 0, rank1


@pytest.mark.parametrize("spec", ["topk_softmax:1", "legacy_mixtral:1", "switch:1"])
def test_ep1_blocks_are_leaf_modules_and_train_at_parity_with_disjoint_routing(launch, spec):
    """The crash of the issue: ZeRO-3, ep_size=1, ranks routing to different experts of blocks that
    skip experts without tokens. Every block is a leaf module; the run trains at parity."""
    result = launch[spec]
    _disjoint_routing(result)
    assert result["source"] == "structure"
    assert result["leaf_blocks"] == PATHS and result["converted"] == []
    assert not [w for w in result["warnings"] if w.startswith("[moe-no-expert-parallel]")]
    assert max(_gaps(result)) <= PARITY  # includes the steps resumed on EP=2 (legacy_mixtral:1)
    assert result.get("resume_ep") == RESUME.get(spec)
    if spec in RESUME:  # saved without EP: exported as trained, by the same names
        _check_export(result["export"], ("w1", "w3", "w2"))


def _check_export(exported: dict[str, Any], own: tuple[str, ...]) -> None:
    """Loaded into a plain model with strict=True; each expert's Linear weights under its own name."""
    assert exported.get("missing") == [] and exported.get("unexpected") == [], exported
    for layer in (0, 1):
        for i in range(4):
            for name in own:
                assert f"layers.{layer}.moe.experts.{i}.{name}.weight" in exported["names"]
    assert not any(".experts.w1" in n or "router.gate" in n for n in exported["names"])
    assert exported["max_abs_logit_gap"] <= 1e-5 * exported["logit_scale"]


@pytest.mark.parametrize("spec, own", [("topk_softmax:2", ("gate_proj", "up_proj", "down_proj")),
                                       ("legacy_mixtral:2", ("w1", "w3", "w2"))])
def test_ep2_converts_module_lists_exports_own_names_and_resumes(launch, spec, own):
    result = launch[spec]
    _disjoint_routing(result)
    assert result["converted"] == PATHS and result["leaf_blocks"] == [] and result["ep_blocks"] == PATHS
    assert not [w for w in result["warnings"] if w.startswith("[moe-")], result["warnings"]
    assert result["autoep"]["expert_w1"] == own[0] and result["autoep"]["expert_w3"] == own[1]
    gaps = _gaps(result)  # 3 steps with EP=2, then 2 resumed steps (EP=1 for topk_softmax, EP=2 for legacy)
    assert max(gaps) <= PARITY, max(gaps)
    assert result["resume_ep"] == RESUME[spec]
    _check_export(result["export"], own)


def test_ep2_switch_falls_back_to_leaf_modules_with_the_one_warning(launch):
    result = launch["switch:2"]
    _disjoint_routing(result)
    assert result["converted"] == [] and result["leaf_blocks"] == PATHS and result["ep_blocks"] == []
    [warning] = [w for w in result["warnings"] if w.startswith("[moe-no-expert-parallel]")]
    assert "ep_size=2, but none of the 2 MoE block(s) found (source: structure)" in warning
    for path in PATHS:
        assert f"\n  {path} (SwitchBlock): its experts are not gated (fc1 -> gelu -> fc2)" in warning
    assert max(_gaps(result)) <= PARITY
