"""The examples run end to end as a user would start them: real 2-rank jobs on CPU.

``examples/quickstart.py`` (the README's quickstart) is the user's script, with no checks of its own:
the test reloads what it exported and checks it. ``examples/finetune_pretrained.py`` checks its own
numbers and exits non-zero when one is off; the test also reads what every rank wrote and checks it
again, so a rank that died quietly fails the test.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

from support.jobs import REPO, job_env, run

DATA = REPO / "examples" / "data"


def _tiny_qwen3_moe(path) -> None:
    """A 2-layer, 4-expert Qwen3-MoE with the repo's tokenizer, saved as a downloaded model is stored."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                            tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "tokenizer" / name, path / name)


def _val_loss(model_dir, tokenizer_dir, seq: int, n: int) -> float:
    """Mean loss of a from_pretrained model over the first ``n`` ``seq``-token rows of the shipped text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)((DATA / "moe_notes.txt").read_text())["input_ids"]
    rows = torch.tensor(ids[: n * seq]).view(n, seq)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return sum(model(input_ids=row[None], labels=row[None]).loss.item() for row in rows) / n


def test_quickstart_on_cpu(tmp_path):
    """The quickstart as CI runs it: the same file on 2 CPU ranks, a tiny Qwen3-MoE saved with
    save_pretrained, the tokenizer and text this repo ships. The model it exported, reloaded here with
    from_pretrained, gives the validation loss of the checkpoint it came from, and not the untrained
    model's (the export holds the trained weights)."""
    _tiny_qwen3_moe(tmp_path / "model")
    settings = {"MODEL": str(tmp_path / "model"), "TEXT": str(DATA / "moe_notes.txt"), "OUT": str(tmp_path / "out"),
                "ACCELERATOR": "cpu", "DEVICES": "2", "EP_SIZE": "2", "PRECISION": "32-true", "MAX_STEPS": "4",
                "SEQ": "64", "LR": "1e-3"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py")], capture_output=True, text=True,
                          timeout=500, env={**job_env(), **settings}, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    best = re.search(r"^best val_loss (\S+) at (.+)$", proc.stdout, re.MULTILINE)
    assert best, proc.stdout[-3000:]
    assert best.group(2).endswith("step=4.ckpt")  # validated and saved at the last step
    exported = _val_loss(tmp_path / "out" / "model", tmp_path / "model", seq=64, n=8)
    assert math.isclose(exported, float(best.group(1)), rel_tol=1e-5), (exported, best.group(1))
    untrained = _val_loss(tmp_path / "model", tmp_path / "model", seq=64, n=8)
    assert abs(untrained - exported) > 1e-3, (untrained, exported)


def test_finetune_pretrained_example(tmp_path):
    """The whole example: train, validate after fit, export to an HF directory, from_pretrained of it."""
    proc = run([sys.executable, str(REPO / "examples" / "finetune_pretrained.py"), "--workdir", str(tmp_path),
                "--through", "reload"], timeout=500)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert any(line.startswith("[train]") for line in lines), proc.stdout
    assert (tmp_path / "pretrained" / "config.json").is_file(), "save_pretrained wrote no HF directory"
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        # The weights the strategy trained from are the saved ones: the pretrained model's loss on
        # the same batch, computed in a plain process.
        assert math.isclose(r["first_loss"], r["pretrained_loss"], rel_tol=1e-4), r
        losses = r["train_losses"]
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0], "fine-tuning should lower the training loss"
    assert results[0]["fit_val_loss"] == results[1]["fit_val_loss"], "val_loss is synced over ranks"
    assert any(line.startswith("[validate]") for line in lines), proc.stdout
    assert math.isclose(results[0]["val_loss"], results[0]["fit_val_loss"], rel_tol=1e-5)
    assert (tmp_path / "exported" / "config.json").is_file(), "the export is not an HF directory"
    assert any(line.startswith("[reload]") for line in lines), proc.stdout
    assert math.isclose(results[0]["reloaded_val_loss"], results[0]["val_loss"], rel_tol=1e-4)
