"""Does export memory stay flat as the checkpoint grows? Export vs DeepSpeed's ``ds_to_universal``.

For each model size: a real ZeRO-3 + AutoEP (EP=2) checkpoint on 2 CPU ranks (our tiny MoE LM
scaled up: ``--hidden``, ``--layers``, 8 experts, 1 optimizer step, saved by
``trainer.save_checkpoint``), then, interleaved ``--repeats`` times, each in a fresh process:

(a) ``export``: ``lightning_zeromoe.checkpoint.export(ckpt, out_dir, max_shard_size=...)``, the
    streaming HF-directory export (fp32 output, i.e. every master weight read and written);
(b) ``ds_to_universal``: ``python -m deepspeed.checkpoint.ds_to_universal`` on the same shards
    (``--num_extract_workers 1 --num_merge_workers 1``), which also reads every rank's fp32
    partitions and writes one file per parameter.

Reported per size and path: wall seconds of the conversion itself (imports excluded, measured
after them), throughput (fp32 master MB / s), peak RSS (the process's ``ru_maxrss``, or its
children's if larger, for (b), which may fork workers) and the RSS after imports, medians over
the repeats. Flat means (a)'s peak RSS barely moves while the checkpoint grows ~10x.

Usage (repository root)::

    .venv/bin/python benchmarks/export_scaling.py                       # 0.2 GB and 2 GB (hidden 1024, 1 and 9 layers)
    .venv/bin/python benchmarks/export_scaling.py --hidden 512 --layers 1 8 --max-shard-size 20MB --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_MEASURE = """
import json, resource, sys, time
{setup}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
{run}
wall = time.perf_counter() - t0
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({{"wall": wall, "rss": rss * 1024, "base": base * 1024}}))
"""


def make_checkpoint(hidden: int, layers: int, out: Path) -> None:
    """Rank 0 and 1 both run this (Lightning re-runs the script for rank 1)."""
    import lightning as L

    sys.path.insert(0, str(REPO))
    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule

    L.seed_everything(0, verbose=False)
    config = TinyMoEConfig(vocab_size=1024, hidden_size=hidden, ffn_hidden_size=2 * hidden, num_layers=layers,
                           num_experts=8, tie_embeddings=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=ZeroMoEStrategy(ep_size=2, param_persistence_threshold=0))
    trainer.fit(TinyMoEModule(config, batch_size=2, num_samples=8))
    trainer.save_checkpoint(out)


def _measure(setup: str, run: str, env: dict[str, str]) -> dict[str, float]:
    """Run ``setup`` (imports, not timed) then ``run`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE.format(setup=setup, run=run)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 9])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-shard-size", default="100MB", help="below the smaller model, so both are sharded")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--make", nargs=2, metavar=("LAYERS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        return make_checkpoint(args.hidden, int(args.make[0]), Path(args.make[1]))

    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="export_scaling_"))
    rows = []
    for layers in args.layers:
        ckpt = work / f"ckpt_L{layers}"
        if not (ckpt / "zeromoe_meta.json").is_file():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--hidden", str(args.hidden), "--make", str(layers), str(ckpt)],
                           check=True, env=env, cwd=REPO, capture_output=True, timeout=3600)
            print(f"checkpoint hidden={args.hidden} layers={layers}: {time.perf_counter() - t0:.0f} s", flush=True)
        meta = json.loads((ckpt / "zeromoe_meta.json").read_text())
        fp32_mb = sum(4 * _prod(s) for s in meta["shapes"].values()) / 1e6
        results: dict[str, list[dict[str, float]]] = {"export": [], "ds_to_universal": []}
        for rep in range(args.repeats):
            out = work / f"out_L{layers}_{rep}"
            results["export"].append(_measure(
                "import huggingface_hub, safetensors.torch\nfrom lightning_zeromoe.checkpoint import export",
                f"export({str(ckpt)!r}, {str(out)!r}, dtype='float32', max_shard_size={args.max_shard_size!r}, "
                "progress=False, overwrite=True)", env))
            uni = work / f"uni_L{layers}_{rep}"
            results["ds_to_universal"].append(_measure(
                "import runpy, sys\nimport deepspeed.checkpoint.ds_to_universal",
                f"sys.argv = ['ds_to_universal', '--input_folder', {str(ckpt / 'checkpoint')!r}, '--output_folder', "
                f"{str(uni)!r}, '--num_extract_workers', '1', '--num_merge_workers', '1', '--no_strict']\n"
                "runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__')", env))
            subprocess.run(["rm", "-rf", str(out), str(uni)], check=False)
        for path, runs in results.items():
            wall = statistics.median(r["wall"] for r in runs)
            rss = statistics.median(r["rss"] for r in runs) / 2**20
            base = statistics.median(r["base"] for r in runs) / 2**20
            rows.append({"layers": layers, "fp32_mb": round(fp32_mb), "path": path, "wall_s": round(wall, 2),
                         "mb_per_s": round(fp32_mb / wall, 1), "peak_rss_mib": round(rss),
                         "rss_after_imports_mib": round(base),
                         "rss_runs_mib": [round(r["rss"] / 2**20) for r in runs]})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| fp32 master state | path | wall s (median) | MB/s | peak RSS MiB (median) | of which after imports |"
          "\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['fp32_mb']} MB | {r['path']} | {r['wall_s']} | {r['mb_per_s']} | {r['peak_rss_mib']} | "
              f"{r['rss_after_imports_mib']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def _prod(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
