"""``python -m lightning_zeromoe.planner --config config.json``: real subprocess runs on local
config files (written from transformers' config classes; nothing is downloaded), their counts
against the same model built with real weights, and the one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support.example_facts import example_facts
from support.jobs import REPO
from lightning_zeromoe.planner import count_params

SMALL_MIXTRAL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_zeromoe.planner", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def write_config(path, config) -> str:
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


def test_cli_plans_a_local_config_with_exact_counts(tmp_path):
    import torch
    import transformers

    config = transformers.MixtralConfig(**SMALL_MIXTRAL)
    out = planner("--config", write_config(tmp_path / "config.json", config), "--gpus", "4", "--gpus-per-node", "2",
                  "--gpu-gb", "0.01", "--seq-len", "32", "--micro-batch", "2", "--accumulation", "2",
                  "--bucket-size", "1000")
    assert out.returncode == 0, out.stderr[-3000:]
    torch.manual_seed(0)
    real = count_params(transformers.MixtralForCausalLM(config))  # real weights, not the meta device
    assert f"{real.total:,} parameters = {real.dense_total:,} dense + {real.expert_total:,} expert" in out.stdout
    assert "(4 experts, top-2, 2 MoE layers, hidden 64, expert FFN 96)" in out.stdout
    rows = re.findall(r"^\| (\d+) \| (ZeRO-[123])( \+ [^|]+)? \|", out.stdout, re.M)
    assert {(int(ep), st) for ep, st, _ in rows} >= {(ep, f"ZeRO-{s}") for ep in (1, 2, 4) for s in (1, 2, 3)}
    assert "Recommendation: ep_size=" in out.stdout
    paste = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r'trainer = L\.Trainer\(accelerator="gpu", devices=2, num_nodes=2, strategy=ZeroMoEStrategy\('
                        r'ep_size=[12], stage=1, reduce_bucket_size=1000, allgather_bucket_size=1000\), '
                        r'precision="bf16-mixed", accumulate_grad_batches=2\)', paste), paste
    # ep_size=4 would cross the 2-GPU nodes: not recommended while a node-local one fits as well.
    assert re.search(r"Recommendation: ep_size=([12]), ZeRO-1: ", out.stdout), out.stdout[-1500:]


def test_cli_model_type_uses_transformers_default_config():
    out = planner("--model-type", "qwen3_moe", "--gpus", "8", "--ep-size", "8", "--seq-len", "128")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("qwen3_moe: ") and "128 experts, top-8" in out.stdout
    assert re.search(r"^\| 8 \| ZeRO-1 \|", out.stdout, re.M) and not re.search(r"^\| 4 \|", out.stdout, re.M)


def test_expert_loop_slows_only_the_unconverted_blocks(capsys):
    # transformers' "eager" experts slice fused tensors at ep_size=1; AutoEP's bf16 grouped GEMM replaces
    # them at ep_size > 1, so only the ep_size=1 rows change (and grow). In this process (the CLI's
    # main, its argument parsing and output; the subprocess runs above cover the entry point).
    from lightning_zeromoe.planner.cli import main

    def step_times(*extra: str) -> dict[tuple[str, str], float]:
        with pytest.raises(SystemExit) as done:
            main(["--model-type", "mixtral", "--gpus", "8", "--seq-len", "512", *extra])
        out = capsys.readouterr()
        assert done.value.code == 0, out.err[-3000:]
        rows = re.findall(r"^\| (\d+) \| (ZeRO-[123]) \|.* \| ([\d.]+) (m?s) \|$", out.out, re.M)
        assert len(rows) == 12, out.out[-2000:]  # ZeRO-1/2/3 at ep_size 1, 2, 4, 8
        return {(e, z): float(v) / (1000 if unit == "ms" else 1) for e, z, v, unit in rows}

    grouped, sliced = step_times(), step_times("--expert-loop", "slices")
    for (ep, zero), seconds in grouped.items():
        if ep == "1":
            assert sliced[ep, zero] > seconds * 1.05, (ep, zero, seconds, sliced[ep, zero])
        else:
            assert sliced[ep, zero] == seconds, (ep, zero, seconds, sliced[ep, zero])


def test_dense_layers_and_shared_experts_are_named_and_run_no_all_to_all(tmp_path, capsys):
    # Qwen2-MoE with a gated shared expert; with mlp_only_layers=[0] its first layer is dense: the
    # header says so, and the all-to-all (per MoE layer) shrinks to 3/4. In this process, as above.
    import transformers

    from lightning_zeromoe.planner.cli import main

    def run(**extra) -> tuple[str, float]:
        config = transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48, **extra)
        with pytest.raises(SystemExit) as done:
            main(["--config", write_config(tmp_path / "config.json", config), "--gpus", "2", "--ep-size", "2",
                  "--seq-len", "32768", "--micro-batch", "16"])  # an all-to-all of GBs: the table's 2 decimals
        out = capsys.readouterr()
        assert done.value.code == 0, out.err[-3000:]
        a2a = re.search(r"^\| 2 \| ZeRO-1 \|(?: [^|]+ \|){5} ([\d.]+) \|", out.out, re.M)
        return out.out.splitlines()[0], float(a2a.group(1))

    header, all_moe = run()
    assert "4 MoE layers, hidden 64, expert FFN 32, shared experts' FFN 48 (gated))" in header, header
    header, one_dense = run(mlp_only_layers=[0])
    assert "3 MoE layers, hidden 64, expert FFN 32, shared experts' FFN 48 (gated), 1 dense layer of FFN 96)" in header
    assert all_moe > 0 and one_dense == pytest.approx(all_moe * 3 / 4, rel=0.02), (one_dense, all_moe)


@pytest.mark.parametrize("case, entry", [
    ("dense", "planner-hf-config"), ("unknown", "planner-hf-config"), ("missing", "planner-hf-config"),
    ("ep", "ep-size-divisibility"),
])
def test_bad_input_is_one_line_with_its_entry_and_exit_2(tmp_path, case, entry):
    import transformers

    if case == "dense":
        args = ["--config", write_config(tmp_path / "c.json", transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))]
    elif case == "unknown":
        args = ["--model-type", "not_a_model"]
    elif case == "missing":
        args = ["--config", str(tmp_path / "missing.json")]
    else:
        args = ["--config", write_config(tmp_path / "c.json", transformers.MixtralConfig(**SMALL_MIXTRAL)),
                "--gpus", "6", "--ep-size", "3"]
    out = planner(*args)
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"[{entry}] "), out.stderr
    assert out.stdout == ""
    from troubleshooter import knowledge

    matches = knowledge.match(lines[0])  # what `python -m troubleshooter explain` shows for it
    assert matches and matches[0].entry.id == entry, [m.entry.id for m in matches]


def test_planning_page_tables_are_what_the_cli_prints():
    """The planning guide's Mixtral-8x7B and Qwen3-30B-A3B tables, each recommendation line and the
    Trainer line to paste come from the configs under examples/configs (in this process: the CLI's own
    functions, with the arguments the page's command gives); so do the ``--mixtral-8x7b`` tables."""
    from lightning_zeromoe.planner import cli as planner_cli
    from lightning_zeromoe.planner.reports import mixtral_report

    page = (REPO / "docs" / "guides" / "planning.md").read_text()
    for line in mixtral_report(num_gpus=8, gpu_memory_gb=80.0).splitlines():
        if line.startswith("|"):
            assert line in page, line
    for config in ("mixtral-8x7b", "qwen3-30b-a3b"):
        facts = example_facts(config)
        for gpus in (8, 16):
            args = planner_cli.build_parser().parse_args([
                "--gpus", str(gpus), "--gpus-per-node", "8", "--gpu-gb", "80", "--seq-len", "4096", "--micro-batch",
                "1", "--activation-checkpointing"])
            lines = planner_cli.report(facts, args).splitlines()
            table = "\n".join(line for line in lines if line.startswith("|"))
            recommendation = next(line for line in lines if line.startswith("Recommendation:"))
            paste = next(line for line in lines if line.startswith("trainer = L.Trainer("))
            assert recommendation in page and paste in page, (config, gpus, recommendation, paste)
            assert table.count("\n") >= 10 and table in page, (config, gpus, table)
