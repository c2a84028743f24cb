"""Train a tiny MoE (ours or HF Mixtral) with ZeRO-3 + AutoEP on 2 CPU ranks, save, and record
what the trained engine computes on a fixed batch: the reference for ``tests/test_checkpoint.py``.

A standalone script (Lightning re-runs it for rank 1); several families train one after the other
in one launch, each in its own directory ``DIR/<family>``::

    python tests/jobs/export_job.py --family tiny mixtral variants --out DIR

Writes the checkpoint (tiny: ``DIR/tiny/callback/step=N.ckpt`` by ``ModelCheckpoint``; mixtral:
``DIR/mixtral/ckpt`` by ``trainer.save_checkpoint``; the path is in the JSON),
``engine_outputs_rank{R}.pt`` (the fixed batch and the engine's logits on it, computed by both ranks
together after training) and ``rank{R}.json`` (the model config, losses, timings) in the family's
directory. ``variants`` is several runs, see :func:`variants`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoEModule  # noqa: E402

VOCAB, SEQ = 128, 17


def fixed_batch() -> torch.Tensor:
    """Not a training batch: another seed of the synthetic data, 2 sequences of 16 tokens."""
    return SyntheticLMData(num_samples=2, seq_len=SEQ - 1, vocab_size=VOCAB, seed=1234).tokens


def mixtral_config() -> "transformers.MixtralConfig":  # noqa: F821
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
                         attn_implementation="sdpa")


class MixtralModule(L.LightningModule):
    """Holds the HF model as ``self.net``; LM loss only."""

    def __init__(self, config, lr: float = 3e-3, batch_size: int = 4) -> None:
        super().__init__()
        from transformers import MixtralForCausalLM

        self.net = MixtralForCausalLM(config)
        self.lr, self.batch_size = lr, batch_size
        self.losses: list[float] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        loss = self.net(input_ids=ids, labels=ids, use_cache=False).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    def train_dataloader(self):
        data = SyntheticLMData(num_samples=128, seq_len=SEQ, vocab_size=VOCAB, seed=0)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", nargs="+", choices=("tiny", "mixtral", "variants"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2, help="4 gives each expert-parallel rank 2 replicas")
    args = parser.parse_args()
    for family in args.family:
        one = argparse.Namespace(**{**vars(args), "family": family, "out": args.out / family})
        if family == "variants":
            variants(one)
        else:
            train(one)


def train(args: argparse.Namespace) -> None:
    """One family: fit, save, and the trained engine's logits on the fixed batch."""
    t0 = time.perf_counter()
    L.seed_everything(0, verbose=False)
    if args.family == "tiny":
        config = TinyMoEConfig(tie_embeddings=True)
        module = TinyMoEModule(config, batch_size=4, num_samples=64)
        config_dict = asdict(config)
    else:
        config = mixtral_config()
        module = MixtralModule(config)
        config_dict = config.to_dict()
    # Both ways users save: the tiny model through ModelCheckpoint (at its last step), Mixtral
    # through trainer.save_checkpoint after fit.
    callbacks = []
    if args.family == "tiny":
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out / "callback", filename="{step}",
                                                             every_n_train_steps=args.steps, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=args.steps, logger=False,
                        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=ZeroMoEStrategy(ep_size=2, param_persistence_threshold=0))
    trainer.fit(module)
    print(f"[rank {trainer.global_rank}] trained {trainer.global_step} steps", file=sys.stderr, flush=True)
    t_save = time.perf_counter()
    if callbacks:
        ckpt_path, save_s = args.out / "callback" / f"step={args.steps}.ckpt", None
    else:
        ckpt_path = args.out / "ckpt"
        trainer.save_checkpoint(ckpt_path)
        save_s = round(time.perf_counter() - t_save, 3)

    # The trained engine (ZeRO-3 partitions, AutoEP layers, all-to-all) on a fixed batch. Both ranks
    # must run it: every forward gathers parameters and exchanges tokens.
    engine = trainer.strategy.model
    engine.eval()
    ids = fixed_batch()
    with torch.no_grad():
        logits = engine(ids)
    rank = trainer.global_rank
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": ids, "logits": logits.detach().float().clone()}, args.out / f"engine_outputs_rank{rank}.pt")
    losses = module.last_losses if args.family == "tiny" else module.losses
    (args.out / f"rank{rank}.json").write_text(json.dumps({
        "family": args.family, "rank": rank, "world_size": trainer.world_size, "global_step": trainer.global_step,
        "config": config_dict, "losses": losses, "ckpt_path": str(ckpt_path), "save_seconds": save_s,
        "wall_seconds": round(time.perf_counter() - t0, 2)}, default=str))


def _engine_outputs(trainer: L.Trainer, out: Path) -> None:
    """The trained engine's logits on the fixed batch (both ranks run it together)."""
    engine = trainer.strategy.model
    engine.eval()
    ids = fixed_batch()
    with torch.no_grad():
        logits = engine(ids)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": ids, "logits": logits.detach().float().clone()},
               out / f"engine_outputs_rank{trainer.global_rank}.pt")


def variants(args: argparse.Namespace) -> None:
    """One launch, several runs, one checkpoint each (``DIR/<run>/ckpt``), for the checkpoint kinds
    users produce besides ZeRO-3 + EP: ZeRO stage 1 and 2 (optimizer from the DeepSpeed config
    section, which DeepSpeed splits into MoE groups itself), a frozen embedding under stage 2 and
    stage 3, DeepSeek-V3 (score-correction bias) and a PEFT LoRA run."""
    sys.path.insert(0, str(Path(__file__).parent))
    from train_hf import HFMoEModule, build_hf_model

    class HFWithForward(HFMoEModule):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids=input_ids, use_cache=False).logits

    ds_adam = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}}}
    runs = [("stage1", "tiny", dict(stage=1, config=ds_adam), None),
            ("stage2_frozen", "tiny", dict(stage=2, config=ds_adam), "model.embed.weight"),
            ("stage3_frozen", "tiny", dict(stage=3), "model.embed.weight"),
            ("deepseek_v3", "deepseek_v3", dict(stage=3), None),
            ("lora", "lora", dict(stage=3, ep_size=1), None),
            # Many times the export test's shard size (~80 MB of fp32 weights), for the memory bound.
            ("wide", "wide", dict(stage=3), None)]
    summary = {}
    for name, family, options, frozen in runs:
        L.seed_everything(0, verbose=False)
        if family in ("tiny", "wide"):
            config = TinyMoEConfig(tie_embeddings=False) if family == "tiny" else TinyMoEConfig(
                tie_embeddings=False, hidden_size=256, ffn_hidden_size=512, num_experts=8, num_layers=6)
            module, config_dict = TinyMoEModule(config, batch_size=4, num_samples=64), asdict(config)
        elif family == "lora":
            from peft import LoraConfig, get_peft_model

            net = build_hf_model("mixtral")
            module = HFWithForward(get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                lora_dropout=0.0)))
            config_dict = net.config.to_dict()
        else:
            module = HFWithForward(build_hf_model(family))
            config_dict = module.net.config.to_dict()
        if frozen:
            module.get_parameter(frozen).requires_grad_(False)
        trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=1 if family == "wide" else 3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0,
                            strategy=ZeroMoEStrategy(**{"ep_size": 2, "param_persistence_threshold": 0, **options}))
        trainer.fit(module)
        trainer.save_checkpoint(args.out / name / "ckpt")
        _engine_outputs(trainer, args.out / name)
        summary[name] = {"family": family, "config": config_dict, "ckpt_path": str(args.out / name / "ckpt"),
                         "frozen": frozen}
        print(f"[rank {trainer.global_rank}] {name}: trained {trainer.global_step} steps", file=sys.stderr, flush=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(summary, default=str))


if __name__ == "__main__":
    # `kill -USR1 <pid>` prints every thread's stack: a hung collective shows where it waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
