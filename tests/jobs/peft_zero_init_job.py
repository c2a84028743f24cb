"""One process, a world of 1: PEFT's LoRA initialisation under a real ``deepspeed.zero.Init``.

A world of one still partitions (each parameter's data is emptied into ``ds_tensor``), which is all
PEFT's in-place initialisation trips on. For each case a tiny Mixtral is wrapped with
``get_peft_model`` twice from the same seeds, once plainly and once under ``zero.Init`` (with or
without :func:`lightning_zeromoe.loading.peft_zero3.peft_init_gathered`); the adapter tensors are
gathered and compared. Prints one JSON object: case -> differing adapter tensors or the error.

    python tests/jobs/peft_zero_init_job.py [--gathered 1,0] [--cases linear,dora]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CASES = {
    "linear": dict(target_modules=["q_proj", "v_proj"]),
    "embedding": dict(target_modules=["embed_tokens", "q_proj"]),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "fused_experts": dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
    "dora": dict(target_modules=["q_proj"], use_dora=True),
}


def _build(lora: dict) -> object:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    base = MixtralForCausalLM(config)
    torch.manual_seed(7)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **lora))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gathered", default="1,0", help="1: with the wrapper, 0: without; both in one process")
    parser.add_argument("--port", default="29611")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--zero-first", action="store_true",
                        help="build each case under zero.Init before the plain one: peft is first imported "
                             "inside the strategy's wrapper, as by a configure_model that imports it itself")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch.distributed as dist

    from lightning_zeromoe.loading.peft_zero3 import peft_init_gathered

    if args.zero_first:
        # As in a strategy run: ``import lightning`` has loaded torch._dynamo, whose first import under
        # zero.Init fails (its polyfill of Tensor.__new__ meets DeepSpeed's patched one); and
        # transformers' model classes, which a configure_model has imported by then.
        import torch._dynamo  # noqa: F401
        import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    dist.init_process_group("gloo", rank=0, world_size=1)  # deepspeed.init_distributed took 40 s more here
    results: dict[str, dict[str, object]] = {}
    for gathered in args.gathered.split(","):
        results[gathered] = _compare(args.cases.split(","), gathered == "1", deepspeed, peft_init_gathered,
                                     zero_first=args.zero_first)
    print("RESULT " + json.dumps(results))
    dist.destroy_process_group()
    return 0


def _compare(cases: list[str], gathered: bool, deepspeed, peft_init_gathered, zero_first: bool = False) -> dict[str, object]:
    """Each case built plainly and under ``zero.Init`` (with or without the wrapper); what differs."""
    import torch

    result: dict[str, object] = {}
    for case in cases:
        if case == "dora" and not gathered:
            continue  # PEFT alone raises IndexError on it (seen by hand); only the strategy's refusal is checked
        lora = CASES[case]
        plain = None if zero_first else {n: p.detach().clone() for n, p in _build(lora).named_parameters()}
        peft_imported_before = "peft" in sys.modules
        try:
            with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1}), \
                    peft_init_gathered(gathered):
                model = _build(lora)
        except ValueError as err:
            result[case] = {"error": str(err)}
            continue
        except Exception as err:  # noqa: BLE001 - what PEFT raises on partitioned tensors, reported by type
            result[case] = {"error": f"{type(err).__name__}: {err}"}
            continue
        if plain is None:
            plain = {n: p.detach().clone() for n, p in _build(lora).named_parameters()}
        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            got = {n: p.detach().clone() for n, p in params.items()}
        partitioned = sorted(n for n, p in params.items() if ".lora_" in n and p.data.numel() == 0)
        # zero.Init builds the *base* weights with other draws; the adapters must be PEFT's own.
        differ = sorted(n for n in plain if ".lora_" in n and not torch.equal(got[n], plain[n]))
        copies = sorted(n for n in got if ".modules_to_save." in n)
        differ += [n for n in copies if not torch.equal(got[n], got[n.replace(".modules_to_save.default.", ".original_module.")])]
        result[case] = {"differ": differ, "partitioned_adapters": len(partitioned),
                        "adapters": sum(".lora_" in n for n in plain), "copies": len(copies),
                        "peft_imported_before": peft_imported_before}
    return result


if __name__ == "__main__":
    raise SystemExit(main())
