"""Train a tiny Hugging Face MoE model under ``ZeroMoEStrategy`` and record what each rank saw.

A standalone script, not a test: Lightning starts the other ranks by re-running this file with
the same arguments, which cannot happen inside pytest's process. ``tests/test_hf_models.py``
runs it as a subprocess and asserts on the per-rank JSON it writes.

Usage::

    python tests/jobs/train_hf.py --family mixtral --out /tmp/hf_mixtral
    python tests/jobs/train_hf.py --family qwen3_moe --out /tmp/hf_qwen --devices 2 --ep-size 2

The model is built from a config (no downloads) and held by the LightningModule as ``self.net``,
not ``self.model``, so AutoEP's preset pattern (``model\\.layers\\.\\d+\\.mlp``) only finds the
blocks because the strategy re-roots it (``net\\.model\\.layers\\.\\d+\\.mlp``) and lends the HF
config to the LightningModule during ``deepspeed.initialize``.

The loss is computed the Hugging Face way: ``labels=...`` plus ``output_router_logits=True``,
so ``out.loss`` = LM loss + ``router_aux_loss_coef`` x ``out.aux_loss``, and ``out.aux_loss`` is
computed by transformers from the router logits its output recorders captured. AutoEP replaces
the router, so whether those recorders still see logits after the replacement is a question
this job answers rather than assumes: every step it also hooks AutoEP's own router projection
(``<block>.router.gate``) and records whether HF's ``out.router_logits`` are exactly those
tensors. If HF captured nothing, the job still trains on the LM loss alone and says so in the
JSON (``router_logits_captured: false``), so the test fails with that fact, not a traceback.

What it measured (deepspeed 0.19.8, transformers 5.22.2, 2 CPU ranks, EP=2): Mixtral, Qwen3-MoE
and MiniMax-M3 hand HF the raw router logits, identical to AutoEP's router outputs, so HF's aux
loss is right. Qwen3.5-MoE gets softmax *probabilities* (AutoEP's Qwen3.5 adapter captures
"post_score"), and HF's load_balancing_loss_func softmaxes them again: the aux loss is wrong and
nearly flat (``router_logits_kind: softmax``). DeepSeek-V2/V3 return router logits without
AutoEP and none with it (their adapter does not retarget HF's recorder); HF computes no aux
loss for them either way. That was DeepSpeed alone: the strategy's bridge
(``lightning_zeromoe.conversion.check.restore_router_logits``) now hands Qwen3.5-MoE raw logits and
records DeepSeek-V2/V3's again (checked for every family by ``tests/test_hf_coverage.py``). The
test runs the first two families only.

Output: ``<out>/rank<R>.json`` per rank.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData  # noqa: E402

VOCAB = 128
SEQ_LEN = 17  # 16 positions of next-token prediction per sequence
#: The first two are the tested ones; the rest are for probing other presets by hand.
FAMILIES = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")


def build_hf_model(family: str) -> torch.nn.Module:
    """A tiny HF MoE causal LM from a config: hidden 64, 2 layers, 4 experts, top-2, vocab 128.

    ``router_aux_loss_coef`` is raised from HF's 0.001 to 0.02 so the aux term is visible in
    the total loss rather than lost in the LM loss's rounding.
    """
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common))
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        # decoder_sparse_step=1 with no mlp_only_layers: every layer is an MoE layer.
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, moe_intermediate_size=48, head_dim=16,
                                                  decoder_sparse_step=1, mlp_only_layers=[], **common))
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(num_experts=4, moe_intermediate_size=48, head_dim=16,
                                                          shared_expert_intermediate_size=48,
                                                          layer_types=["linear_attention", "full_attention"],
                                                          **common))
    if family in ("deepseek_v2", "deepseek_v3"):
        import transformers

        name = "DeepseekV2" if family == "deepseek_v2" else "DeepseekV3"
        config_cls, model_cls = getattr(transformers, name + "Config"), getattr(transformers, name + "ForCausalLM")
        # Layer 0 dense (first_k_dense_replace=1), layers 1-2 MoE with a shared expert; small MLA ranks.
        extra = dict(n_group=2, topk_group=1) if family == "deepseek_v3" else {}
        return model_cls(config_cls(**dict(common, num_hidden_layers=3, num_key_value_heads=4), n_routed_experts=4,
                                    n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=48,
                                    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=16, **extra))
    if family == "minimax_m3":
        from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

        return MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(
            **dict(common, num_hidden_layers=3), head_dim=16, num_local_experts=4, dense_intermediate_size=64,
            shared_intermediate_size=32, index_head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"],
            bos_token_id=None, eos_token_id=None))
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


class HFMoEModule(L.LightningModule):
    """Holds the HF model as ``self.net`` and trains it on HF's own loss (LM + aux)."""

    def __init__(self, net: torch.nn.Module, lr: float = 3e-3, batch_size: int = 4) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.batch_size = batch_size
        self.records: list[dict[str, Any]] = []
        # A copy (not a view, not a parameter) of every block's full expert down-projection before
        # AutoEP and ZeRO-3 touch it: after conversion each rank's local experts are matched back
        # to these rows, which says *which* experts a rank holds, not only how many.
        self.original_down_proj = {name: m.experts.down_proj.detach().clone()
                                   for name, m in self.named_modules()
                                   if hasattr(m, "experts") and hasattr(getattr(m, "experts"), "down_proj")}
        self.local_expert_ids: dict[str, list[int | None]] = {}

    def on_train_start(self) -> None:
        import deepspeed
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

        for name, m in self.named_modules():
            if not isinstance(m, AutoEPMoELayer):
                continue
            # ZeRO-3 partitions w2 too: gather it (read-only) to compare whole expert matrices.
            with deepspeed.zero.GatheredParameters([m.experts.w2]):
                local = m.experts.w2.detach().clone()
            full = self.original_down_proj.get(name)
            self.local_expert_ids[name] = [
                next((e for e in range(full.shape[0]) if torch.equal(full[e], local[i])), None) if full is not None
                else None for i in range(local.shape[0])]

    def _autoep_router_gates(self) -> list[torch.nn.Module]:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

        return [m.router.gate for m in self.net.modules() if isinstance(m, AutoEPMoELayer)]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        seen: list[torch.Tensor] = []
        hooks = [g.register_forward_hook(lambda _m, _i, out: seen.append(out)) for g in self._autoep_router_gates()]
        try:
            out = self.net(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        captured = tuple(getattr(out, "router_logits", None) or ())
        aux = getattr(out, "aux_loss", None)
        record: dict[str, Any] = {
            "step": int(self.global_step),
            "batch_indices": [int(i) for i in batch["index"]],
            "router_logits_captured": len(captured) > 0,
            "num_router_logits": len(captured),
            "router_logits_shapes": [list(t.shape) for t in captured],
            "autoep_router_calls": len(seen),
            # The HF recorder must hold AutoEP's router outputs themselves, not stale or other tensors.
            "router_logits_are_autoep_router_outputs": (
                len(captured) == len(seen) and len(seen) > 0
                and all(a is b or (a.shape == b.shape and torch.equal(a, b)) for a, b in zip(captured, seen))),
            # What HF got, per layer: "raw" router logits (what HF's load_balancing_loss_func expects:
            # it applies softmax itself), "softmax" (probabilities: the aux loss would softmax twice)
            # or "other".
            "router_logits_kind": [_logits_kind(t, seen) for t in captured],
            "aux_loss": None if aux is None else float(aux.detach()),
        }
        loss = out.loss
        if aux is not None:
            coef = float(self.net.config.router_aux_loss_coef)
            record["lm_loss"] = float(loss.detach() - coef * aux.detach())
        else:
            record["lm_loss"] = float(loss.detach())
        record["loss"] = float(loss.detach())
        self.records.append(record)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        data = SyntheticLMData(num_samples=256, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=0)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)


def _logits_kind(captured: torch.Tensor, router_outputs: list[torch.Tensor]) -> str:
    """How a tensor HF captured relates to the outputs of AutoEP's router projection."""
    same_shape = [t for t in router_outputs if t.shape == captured.shape]
    if any(torch.equal(captured, t) for t in same_shape):
        return "raw"
    if any(torch.allclose(captured.float(), torch.softmax(t.float(), dim=-1), atol=1e-6) for t in same_shape):
        return "softmax"
    return "other"


def partition_report(module: HFMoEModule, strategy: ZeroMoEStrategy) -> dict[str, Any]:
    """What this rank actually holds: converted block types and each parameter's ZeRO-3 shard.

    ``ds_shape`` is the shape of the parameter as this rank's model sees it once gathered (for
    AutoEP experts: the rank's local experts only); ``ds_tensor`` is the partition this rank
    stores. Both are read from the live parameters, not from the config.
    """
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    named = dict(module.named_modules())
    blocks = {b.path: type(named[b.path]).__name__ if b.path in named else None
              for b in strategy.discovery.blocks}
    converted = {}
    for name, m in module.named_modules():
        if isinstance(m, AutoEPMoELayer):
            converted[name] = {"num_experts": int(m.num_experts), "num_local_experts": int(m.num_local_experts),
                               "ep_size": int(m.ep_size), "ep_rank": int(m.ep_rank), "top_k": int(m.top_k)}

    def shard(p: torch.nn.Parameter) -> dict[str, Any]:
        ds_tensor = getattr(p, "ds_tensor", None)
        return {"ds_shape": list(getattr(p, "ds_shape", p.shape)), "ds_numel": int(getattr(p, "ds_numel", p.numel())),
                "partition_numel": None if ds_tensor is None else int(ds_tensor.numel())}

    experts, dense = {}, {}
    for name, p in module.named_parameters():
        (experts if ".experts." in name else dense)[name] = shard(p)
    return {"blocks": blocks, "autoep_layers": converted, "expert_params": experts, "dense_params": dense}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # Every rank builds the same initial weights: the script runs once per rank.
    L.seed_everything(args.seed, workers=True, verbose=False)
    module = HFMoEModule(build_hf_model(args.family))
    strategy = ZeroMoEStrategy(ep_size=args.ep_size, param_persistence_threshold=0)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    t_fit = time.perf_counter()
    trainer.fit(module)
    fit_s = time.perf_counter() - t_fit

    report = {
        "family": args.family,
        "hf_class": type(module.net).__name__,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "ep_size": args.ep_size,
        "global_step": int(trainer.global_step),
        "steps_run": len(module.records),
        "losses": [r["loss"] for r in module.records],
        "lm_losses": [r["lm_loss"] for r in module.records],
        "aux_losses": [r["aux_loss"] for r in module.records],
        "steps": module.records,
        "discovery": {"source": strategy.discovery.source, "autoep": strategy.discovery.autoep,
                      "blocks": [[b.path, b.num_experts, b.top_k] for b in strategy.discovery.blocks]},
        "expert_parallel_config": strategy.config.get("expert_parallel"),
        "local_expert_ids": module.local_expert_ids,
        "root_config_restored": "config" not in module.__dict__,
        "fit_seconds": round(fit_s, 2),
        "wall_seconds": round(time.perf_counter() - T0, 2),
        **partition_report(module, strategy),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))
    finite = all(math.isfinite(x) for x in report["losses"])
    print(f"[rank {trainer.global_rank}] {args.family}: losses {['%.4f' % x for x in report['losses']]} "
          f"aux {report['aux_losses'][:1]}... fit {fit_s:.1f}s wall {report['wall_seconds']:.1f}s", flush=True)
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
