"""The planner's model of the peer's layout (transformers' native FSDP2 + EP,
``lightning_zeromoe/planner/native_ep.py``) against what transformers really does: a tiny Mixtral saved
with ``save_pretrained`` and loaded on 2 CPU ranks (gloo, torchrun) with
``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2, ep_size=...))``; every
parameter's DTensor local shape on each rank, and the bytes of one training step's collectives, are
compared with the model's prediction for that config and world size. And the planner's side-by-side
printout for Mixtral-8x7B and Qwen3-30B-A3B on 8 and 16 GPUs (in process, the CLI's own functions)."""

from __future__ import annotations

import re
import sys

import pytest

from support.example_facts import example_facts
from support.jobs import REPO, free_port, read_ranks, run_job
from lightning_zeromoe.planner import native_ep
from lightning_zeromoe.planner.native_ep import NativeLayout, NativeTraffic

#: Odd vocabulary: the embedding and head do not split evenly over 2 ranks (torch.chunk's 501 + 500 rows).
TINY = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
TOKENS = 16


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    import torch
    import transformers

    base = tmp_path_factory.mktemp("native_ep")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY)).save_pretrained(base / "model")
    (base / "out").mkdir()
    run_job("native_ep_layout.py", "--model", str(base / "model"), "--out", str(base / "out"), "--tokens", str(TOKENS),
            timeout=600, launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--master-addr", "127.0.0.1", "--master-port", str(free_port())])
    from lightning_zeromoe.planner import cli

    facts = cli.model_facts(cli.load_config(str(base / "model")))
    return read_ranks(base / "out", 2), facts


@pytest.mark.parametrize("run, ep_size", [("ep2_bf16", 2), ("ep1_fp32", 1)])
def test_local_shapes_are_the_ones_transformers_applies(launched, run, ep_size):
    ranks, facts = launched
    layout = NativeLayout(world=2, ep_size=ep_size)
    units = facts.native_units(ep_size)
    by_name = {t.name: (u, t) for u in units for t in u.tensors}
    assert set(by_name) == set(ranks[0][run]["shapes"]), "the planner's tensors are the model's"
    assert any(u.expert for u in units) == (ep_size > 1)
    for rank, record in enumerate(ranks):
        dense = expert = 0
        for name, seen in record[run]["shapes"].items():
            unit, tensor = by_name[name]
            assert seen["dtensor"] and tuple(seen["full"]) == tensor.shape, (name, seen)
            group = layout.group(unit)
            index = rank // ep_size if unit.expert else rank
            rows = native_ep.local_rows(layout.rows_here(tensor), group, index)
            assert seen["local"] == [rows, *tensor.shape[1:]], (run, rank, name, seen["local"], rows)
            n = 1
            for d in seen["local"]:
                n *= d
            dense, expert = (dense, expert + n) if tensor.expert else (dense + n, expert)
        predicted = {False: 0, True: 0}
        for unit in units:
            for t in unit.tensors:
                one = native_ep.NativeUnit(unit.name, (t,), unit.expert, unit.reshard_after_forward)
                predicted[t.expert] += native_ep.local_elements(one, layout, rank)
        assert (dense, expert) == (predicted[False], predicted[True]), (run, rank)
    # the embedding's and head's 1001 rows: 501 on rank 0, 500 on rank 1
    assert [r[run]["shapes"]["lm_head.weight"]["local"][0] for r in ranks] == [501, 500]


@pytest.mark.parametrize("run, ep_size, precision", [("ep2_bf16", 2, "bf16"), ("ep1_fp32", 1, "fp32")])
def test_bytes_per_step_are_what_fsdp2_and_the_dispatch_pass(launched, run, ep_size, precision):
    ranks, facts = launched
    layout = NativeLayout(world=2, ep_size=ep_size)
    traffic = NativeTraffic(tokens_per_micro_batch=TOKENS, top_k=2, hidden_size=64, moe_layers=2, num_experts=4)
    predicted = native_ep.native_comm(facts.native_units(ep_size), layout, precision, traffic)
    for record in ranks:
        seen = record[run]["comm"]
        # at world 2 the fsdp group is the world group; efsdp = 2 / ep_size
        for collective in ("all_gather", "reduce_scatter"):
            assert sum(seen["bytes"].get(f"{collective}/{g}", 0) for g in ("world", "other")) == sum(
                predicted.bytes.get((collective, g), 0) for g in ("world", "expert_data_parallel")), collective
        assert seen["calls"]["all_gather/world"] == predicted.calls[("all_gather", "world")]
        assert seen["calls"]["reduce_scatter/world"] == predicted.calls[("reduce_scatter", "world")]
    if ep_size > 1:
        # Forward only is visible (backward runs inside autograd): per MoE layer the counts (E x int64),
        # the dispatch and the combine; summed over ranks, dispatch + combine carry 2 x T x k rows.
        rows = TOKENS * 2 * 64 * 2  # tokens x top-k x hidden x bf16
        assert sum(r[run]["dispatch_forward_bytes"] for r in ranks) == 2 * 2 * rows * 2  # ranks x layers x rows x 2
        assert all(r[run]["counts_bytes"] == 2 * 4 * 8 and r[run]["dispatch_forward_calls"] == 4 for r in ranks)
        per_rank_forward = 2 * (2 * rows + 4 * 8)  # layers x (dispatch + combine + counts)
        backward = 2 * 2 * rows
        assert predicted.bytes[("all_to_all", "expert_parallel")] == per_rank_forward + backward
    else:
        assert all(r[run]["dispatch_forward_calls"] == 0 for r in ranks)


@pytest.mark.parametrize("config", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_planner_prints_both_layouts_side_by_side(config):
    """``--compare-native`` for Mixtral-8x7B and Qwen3-30B-A3B on 8 and 16 GPUs (in process, the CLI's own
    functions): every valid ep_size, the states the native model gives, the differences by design, and the
    printout is the one docs/choosing-layouts.md carries."""
    from lightning_zeromoe.planner import cli

    facts = example_facts(config)
    page = (REPO / "docs/choosing-layouts.md").read_text()
    for gpus in (8, 16):
        args = cli.build_parser().parse_args(["--gpus", str(gpus), "--gpus-per-node", "8", "--gpu-gb", "80",
                                              "--seq-len", "4096", "--micro-batch", "1",
                                              "--activation-checkpointing", "--compare-native"])
        text = cli.report(facts, args)
        # docs/choosing-layouts.md carries this printout: both tables and the two summary lines
        tables = re.findall(r"((?:^\|.*\n?)+)", text, re.M)
        assert len(tables) == 2, (config, gpus)
        for part in tables + [line for line in text.splitlines() if line.startswith(("Peer's fastest", "Ours: "))]:
            assert part.strip() in page, (config, gpus, part[:200])
        assert f"--config examples/configs/{config}.json --gpus {gpus} " in page
        rows = re.findall(r"^\| (\d+) \| (FSDP2[^|]*?) \| ([\d.]+) \| ([\d.]+) \| (yes|no) \|", text, re.M)
        eps = sorted({int(e) for e, *_ in rows})
        assert eps == [e for e in cli.valid_ep_sizes(facts.num_experts, gpus)], (config, gpus, eps)
        assert "ZeRO-3 gathers each module's parameters" in text and "no ZeRO-1/2" in text
        for ep, setup, states, _, _ in rows:
            layout = NativeLayout(gpus, int(ep))
            est = native_ep.native_states(facts.native_units(int(ep)), layout, "bf16", offload="offload" in setup)
            assert float(states) == pytest.approx(est.device_total / 1e9, abs=0.051)
        # 16 bytes per parameter either way, so ZeRO-3 and FSDP2 hold the same states where FSDP2's dim-0
        # shards split the experts evenly; where a group has more ranks than experts per rank (Mixtral's 8
        # experts on 16 GPUs), FSDP2 puts whole experts on some ranks and padding on the others.
        ours = re.findall(r"^\| (\d+) \| ZeRO-3 \| ([\d.]+) \|", text, re.M)
        theirs = {int(e): float(s) for e, setup, s, _, _ in rows if setup.strip() == "FSDP2"}
        assert len(ours) == len(theirs)
        for ep, states in ours:
            even = (facts.num_experts // int(ep)) % (gpus // int(ep)) == 0
            if even:
                assert theirs[int(ep)] == pytest.approx(float(states), rel=0.02), (config, gpus, ep)
            else:
                assert theirs[int(ep)] > 1.5 * float(states), (config, gpus, ep)
        assert "whole experts" in text
