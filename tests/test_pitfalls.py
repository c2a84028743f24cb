"""ZeRO-3 pitfalls: first reproduced under raw DeepSpeed (2 CPU ranks, no strategy), then handled or
stopped by ZeroMoEStrategy (2 CPU ranks, ZeRO-3 + AutoEP=2), plus single-process unit tests.

Two launches in all (``tests/jobs/pitfall_raw.py``, ``tests/jobs/pitfall_strategy.py``), each
running several cases, because start-up dominates on the 2 shared CPU cores.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from support.modules import MovesItself
from support.jobs import JOBS, read_ranks, run_job
from lightning_zeromoe.engine import pitfalls
from lightning_zeromoe.engine.pitfalls import device_guard
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

COUNT_KEYS = ("collective", "sync_gather", "on_demand", "auto_register")


def _mover_call_site() -> str:
    """``_pitfall_common.py:<line>`` of the Mover's ``.to``/``.half`` call: what the guard must name."""
    lines = (JOBS / "_pitfall_common.py").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "getattr(self.lin, method)(*args)" in text)
    return f"_pitfall_common.py:{line}"


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("pitfall_raw")
    run_job("pitfall_raw.py", "--out", str(out), "--steps", "2", timeout=400)
    return read_ranks(out, 2)


@pytest.fixture(scope="module")
def strat(tmp_path_factory):
    out = tmp_path_factory.mktemp("pitfall_strategy")
    run_job("pitfall_strategy.py", "--out", str(out), timeout=400)
    return read_ranks(out, 2)


def counts(step: dict) -> dict:
    return {k: step[k] for k in COUNT_KEYS}


# ------------------------------------------------------------------ 1. tied and shared weights


def test_raw_tied_weight_registration_changes_nothing(raw):
    """Tied lm_head (one Parameter held by embed and lm_head): DeepSpeed fetches it with each holder.
    Registering it on lm_head gives the very same gathers at every step: no benefit to claim."""
    for rank in raw:
        auto, reg = rank["sharing"]["tied/auto"], rank["sharing"]["tied/registered"]
        assert auto["tie_kept_after_initialize"] and reg["tie_kept_after_initialize"]
        assert auto["external_registry"] == {}, "DeepSpeed should need no external registration for a tie"
        assert [counts(s) for s in auto["steps"]] == [counts(s) for s in reg["steps"]]
        assert all(s["sync_gather"] == 0 for s in auto["steps"])
        # After the traced first step, everything comes in one prefetched all-gather per step.
        assert len(auto["steps"]) == 2 and auto["steps"][1]["collective"] == 1
        assert [s["loss"] for s in auto["steps"]] == [s["loss"] for s in reg["steps"]]


def test_raw_functional_use_is_gathered_synchronously_once(raw):
    """A parameter read in another module's forward: without registration DeepSpeed registers it by
    itself and gathers it synchronously on step 1; explicit registration removes exactly that one
    synchronous gather (and one collective). From step 2 on the counts are identical."""
    for rank in raw:
        auto, reg = rank["sharing"]["functional/auto"], rank["sharing"]["functional/registered"]
        a1, r1 = auto["steps"][0], reg["steps"][0]
        assert (a1["sync_gather"], a1["auto_register"]) == (1, 1)
        assert (r1["sync_gather"], r1["auto_register"]) == (0, 0)
        assert a1["collective"] - r1["collective"] == 1
        assert [counts(s) for s in auto["steps"][1:]] == [counts(s) for s in reg["steps"][1:]]
        assert auto["external_registry"] == {"<root>": 1} == reg["external_registry"]
        assert [s["loss"] for s in auto["steps"]] == [s["loss"] for s in reg["steps"]]


def test_strategy_tie_logged_and_survives_setup_save_and_load(strat):
    for rank in strat:
        train, resume = rank["train"], rank["resume"]
        assert train["tied"] == [["model.embed.weight", "model.lm_head.weight"]]
        assert train["tie_is_one_object"] and resume["tie_is_one_object"]
        assert train["embed_at_start"] == train["lm_head_at_start"]
        # The resumed engine holds exactly what the first run trained (loaded into the tied tensor).
        assert resume["embed_at_start"] == train["embed_at_end"] == resume["lm_head_at_start"]
        assert train["embed_at_end"] != train["embed_at_start"], "the tied weight should have trained"
    assert strat[0]["train"]["checkpoint_shared_params"] == {"model.lm_head.weight": "model.embed.weight"}


def test_strategy_reports_functional_use_and_declaration_removes_first_step_sync_gather(strat):
    for rank in strat:
        train, resume = rank["train"], rank["resume"]
        want = {"module": "model", "parameter": "model.layers.0.attn.out.weight", "pinned": False}
        assert train["external"] == [{**want, "registered_by": "deepspeed"}]
        assert resume["external"] == [{**want, "registered_by": "strategy"}]
        assert resume["declared"] == [["model", "model.layers.0.attn.out.weight"]]
        assert (train["steps"][0]["sync_gather"], train["steps"][0]["auto_register"]) == (1, 1)
        assert (resume["steps"][0]["sync_gather"], resume["steps"][0]["auto_register"]) == (0, 0)
        assert train["steps"][0]["collective"] - resume["steps"][0]["collective"] == 1


# ------------------------------------------------------------------ 2. device and dtype moves


def test_raw_moves_in_forward_fail_obscurely_or_detach(raw):
    """Unguarded: a same-device move is harmless; .half() leaves the gathered copy in fp16 over an fp32
    partition and fails in the matmul; .to('meta') replaces the Parameter, which ZeRO-3 no longer
    knows; .cuda() fails with torch's own message. None of the errors says why."""
    for rank in raw:
        moves = rank["moves"]
        assert moves["to('cpu',)"]["completed"] and moves["to('cpu',)"]["weight_trained"]
        half = moves["half()"]
        assert not half["completed"] and "same dtype" in half["error"]
        assert half["param_data"] == "torch.float16/cpu" and half["partition"] == "torch.float32/cpu"
        meta = moves["to('meta',)"]
        assert not meta["completed"] and not meta["still_zero_param"] and "ds_status" in meta["error"]
        # torch's own message: a CPU build "Torch not compiled with CUDA enabled"; a CUDA build without a
        # GPU (PyPI's torch 2.15.0+cu132 on this machine) "Found no NVIDIA driver on your system"
        cuda = moves["cuda()"]
        assert not cuda["completed"] and any(m in cuda["error"] for m in ("not compiled with CUDA",
                                                                           "Found no NVIDIA driver")), cuda
        assert not any("ZeRO" in m.get("error", "") for m in moves.values())


def test_strategy_stops_moves_with_a_clear_error_and_warns_once_for_no_ops(strat):
    site = _mover_call_site()
    for rank in strat:
        train = rank["train"]
        errors = train["mover_errors"]
        assert sorted(errors) == ["cuda()", "half()", "to('meta',)"]
        for text in errors.values():
            assert text.startswith("ZeroDeviceMoveError:") and "module 'model.mover.lin' (Linear)" in text
            assert site in text and "during forward" in text
            assert "ZeRO-3 cannot allow this" in text and "partition" in text and "optimizer" in text
        assert "cast it to torch.float16" in errors["half()"] and "move it to meta" in errors["to('meta',)"]
        # Nothing was changed: the weight is still a ZeRO-3 parameter, fp32, on the CPU.
        assert train["mover_weight"] == {"still_zero_param": True, "dtype": "torch.float32", "device": "cpu"}
        no_ops = [w for w in train["warnings"] if "ignored (a no-op)" in w]
        assert len(no_ops) == 2, no_ops  # .to('cpu') and .float(), 2 steps each: one warning per call
        assert any(w.startswith("[zero3-noop-move] ZeroMoEStrategy: .to('cpu') on module 'model.mover.lin'") for w in no_ops)
        assert any(w.startswith("[zero3-noop-move] ZeroMoEStrategy: .float() on module 'model.mover.lin'") for w in no_ops)
        assert all(site in w for w in no_ops)
        # From a callback (outside forward): a same-device call runs silently, a cast is refused.
        outside = train["outside_forward"]
        assert outside["to"] == "ok"
        assert outside["half"].startswith("ZeroDeviceMoveError:") and "after the DeepSpeed engine was set up" in outside["half"]


def test_raw_zero_init_skips_module_to(raw):
    """The reason the strategy moves buffers itself: for a zero.Init model the engine never calls
    module.to(device) (it does for a plain model)."""
    for rank in raw:
        assert rank["buffers"]["plain"]["root_to_calls"] == 1
        assert rank["buffers"]["zero_init"]["root_to_calls"] == 0


def test_move_buffers_moves_buffers_not_parameters():
    """On a CPU-only machine the other device is 'meta'; the function is device-agnostic."""
    model = TinyMoELM(TinyMoEConfig(num_layers=1))
    shared = torch.zeros(3)
    model.layers[0].register_buffer("shared", shared)
    model.norm.register_buffer("shared", shared, persistent=False)
    params = {n: p for n, p in model.named_parameters()}
    moved = pitfalls.move_buffers_to_device(model, "meta")
    assert sorted(moved) == ["layers.0.mlp.tokens_per_expert", "layers.0.shared"]
    assert all(b.device.type == "meta" for b in model.buffers())
    assert model.layers[0].shared is model.norm.shared, "a shared buffer must stay shared"
    assert "shared" in model.norm._non_persistent_buffers_set
    assert all(p is params[n] and p.device.type == "cpu" for n, p in model.named_parameters())
    assert pitfalls.move_buffers_to_device(model, "meta") == []


def test_guard_outside_zero_and_removal_restore_torch():
    """Modules without ZeRO-3 parameters move freely; inside forward a same-device call warns once;
    removing the last guard restores nn.Module's own methods."""
    original_to = nn.Module.to

    net = MovesItself()
    guard = pitfalls.DeviceMoveGuard(net, torch.device("cpu")).install()
    try:
        assert nn.Module.to is not original_to
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                net(torch.ones(1, 2))
        msgs = [str(w.message) for w in caught]
        assert len(msgs) == 1 and "module 'lin'" in msgs[0] and "support/modules.py:" in msgs[0]
        net.lin.half()  # no ZeRO-3 parameters: nothing to detach, so it is allowed
        assert net.lin.weight.dtype == torch.float16
    finally:
        guard.remove()
    assert nn.Module.to is original_to and not device_guard._GUARDED


def test_requested_parses_every_move_method():
    cases = [
        (("to", ("cpu",), {}), (torch.device("cpu"), None, False)),
        (("to", (torch.float16,), {}), (None, torch.float16, False)),
        (("to", (), {"device": "meta", "dtype": torch.bfloat16}), (torch.device("meta"), torch.bfloat16, False)),
        (("cuda", (1,), {}), (torch.device("cuda", 1), None, False)),
        (("cpu", (), {}), (torch.device("cpu"), None, False)),
        (("double", (), {}), (None, torch.float64, False)),
        (("type", (torch.bfloat16,), {}), (None, torch.bfloat16, False)),
        (("type", ("torch.DoubleTensor",), {}), (torch.device("cpu"), torch.float64, False)),
    ]
    for (method, args, kwargs), want in cases:
        assert device_guard._requested(method, args, kwargs) == want, method


# ------------------------------------------------------------------ 3. stale copies


def test_raw_cached_data_never_trains_and_nothing_complains(raw):
    for rank in raw:
        stale = rank["stale"]
        assert not stale["sidecar_weight_changed"] and stale["head_weight_changed"]
        assert stale["cache_equals_initial_weight"]
        # The cache pins the full weight; the rank's own partition is half of it.
        assert stale["cache_numel"] == stale["full_numel"] == 2 * stale["partition_numel"]
        assert stale["warnings"] == []


def test_strategy_names_the_stale_parameter_and_the_alias(strat):
    for rank in strat:
        train = rank["train"]
        assert train["stale"] == ["model.sidecar.weight"], "only the cached weight may be flagged"
        assert train["aliases"] == [{"attribute": "model.sidecar.cached", "parameter": "model.sidecar.weight",
                                     "numel": 4096}]
        assert train["sidecar_at_end"] == train["sidecar_at_start"]
        assert train["audit_done"] and not train["audit_hooks_left"]
        # Resumed without the cache: the same weight trains now.
        assert rank["resume"]["sidecar_at_end"] != rank["resume"]["sidecar_at_start"]
        assert not rank["resume"]["audit_hooks_left"]
    warned = strat[0]["train"]["warnings"]
    stale_msg = next(w for w in warned if "received no gradient" in w)
    assert "model.sidecar.weight" in stale_msg and "(on 2 of 2 ranks)" in stale_msg
    assert "in the first 2 optimizer steps" in stale_msg  # grad_audit_steps=2 in the job
    assert "cached `.data`" in stale_msg and "detached copy" in stale_msg and "branch that did not run" in stale_msg
    assert any("model.sidecar.cached holds a full-size tensor" in w for w in warned)


def test_grad_audit_single_process_flags_unused_and_removes_hooks():
    """Without DeepSpeed: an unused parameter is flagged after K steps and every hook is gone."""
    model = nn.ModuleDict({"used": nn.Linear(2, 2), "unused": nn.Linear(2, 2)})
    model["unused"].bias.requires_grad_(False)
    audit = pitfalls.GradAudit(model, steps=2).install()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports = []
    for _ in range(3):
        model["used"](torch.ones(1, 2)).sum().backward()
        opt.step()
        reports.append(audit.step())
    assert reports[0] is None and reports[2] is None
    assert [s.name for s in reports[1].stale] == ["unused.weight"]  # the frozen bias is not reported
    assert not audit.active
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters() if p._post_accumulate_grad_hooks is not None)
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError):
        pitfalls.GradAudit(model, steps=0)


# ------------------------------------------------------------------ detection helpers, options


def test_tied_detection_and_broken_ties():
    model = TinyMoELM(TinyMoEConfig(tie_embeddings=True, num_layers=1))
    tied = pitfalls.find_tied_parameters(model)
    assert [t.paths for t in tied] == [("embed.weight", "lm_head.weight")]
    assert tied[0].numel == model.embed.weight.numel()
    assert pitfalls.broken_ties(model, tied) == []
    assert pitfalls.find_tied_parameters(TinyMoELM(TinyMoEConfig(num_layers=1))) == []
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
    assert pitfalls.broken_ties(model, tied) == ["embed.weight = lm_head.weight (now separate tensors)"]
    assert pitfalls.find_external_uses(model) == []  # not a ZeRO-3 model: DeepSpeed's registry is empty


def test_register_shared_parameters_names_and_errors():
    model = TinyMoELM(TinyMoEConfig(num_layers=1))
    done = pitfalls.register_shared_parameters(model, {"": ["layers.0.attn.out.weight"]})
    assert done == [("", "layers.0.attn.out.weight")]
    assert list(model._external_params.values()) == [model.layers[0].attn.out.weight]
    uses = pitfalls.find_external_uses(model, done)
    assert [(u.module, u.parameter, u.registered_by) for u in uses] == [("<root>", "layers.0.attn.out.weight", "strategy")]
    with pytest.raises(KeyError, match="no module named 'nope'"):
        pitfalls.register_shared_parameters(model, {"nope": ["embed.weight"]})
    with pytest.raises(KeyError, match="no parameter named 'embed.nope'"):
        pitfalls.register_shared_parameters(model, {"": ["embed.nope"]})


def test_strategy_options_are_validated_and_stored():
    import lightning  # noqa: F401  (import order: Lightning before the strategy module)

    from lightning_zeromoe import ZeroMoEStrategy

    s = ZeroMoEStrategy(grad_audit_steps=5, guard_device_moves=False, shared_parameters={"model": ("model.x",)})
    o = s.pitfalls.options
    assert (o.grad_audit_steps, o.guard_device_moves, o.register_tied_parameters) == (5, False, True)
    assert o.shared_parameters == {"model": ["model.x"]}
    with pytest.raises(ValueError, match="grad_audit_steps"):
        ZeroMoEStrategy(grad_audit_steps=-1)


