"""``examples/finetune_pretrained.py`` runs end to end as a user would start it: a real 2-rank job.

The example checks its own numbers and exits non-zero when one is off; this test also reads what
every rank wrote and checks it again, so a rank that died quietly fails the test.
"""

from __future__ import annotations

import json
import math
import sys

from support.jobs import REPO, run

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
