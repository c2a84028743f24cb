"""One rank of the check of the planner's model of transformers' FSDP2 + EP layout (run by
tests/test_native_ep.py under torchrun, 2 ranks, gloo).

Loads a tiny Mixtral saved with ``save_pretrained`` through transformers' own path,
``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2, ep_size=...))``, twice: with
``ep_size=2`` and bf16 mixed precision (``fsdp_mixed_precision=True``), and with ``ep_size=1`` in fp32.
For each it records every parameter's full shape and its DTensor's local shape on this rank, then
trains one step (AdamW, one micro-batch) under :class:`~lightning_zeromoe.observe.comm_ledger.CommLedger`,
which counts the ``torch.distributed`` collectives FSDP2 calls (gathers, reduce-scatters). Token
dispatch calls two names ``transformers.distributed.expert_parallel`` imported, which the ledger's
wrappers of ``torch.distributed`` do not reach: ``all_to_all_single`` (the per-expert counts) and
torch's functional ``all_to_all_single_autograd`` (the tokens, whose backward runs inside autograd);
their forward calls are counted here by wrapping those two names. Writes ``OUT/rank{r}.json``.

    torchrun --nproc-per-node 2 tests/jobs/native_ep_layout.py --model DIR --out DIR --tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed import expert_parallel

    from lightning_zeromoe.observe.comm_ledger import CommLedger

    rank = int(os.environ["RANK"])
    dispatched: list[int] = []
    counts: list[int] = []

    def counting(original, calls, sent_at):
        def counted(*a, **kw):
            sent = a[sent_at]
            calls.append(sent.numel() * sent.element_size())
            return original(*a, **kw)
        return counted

    expert_parallel.all_to_all_single_autograd = counting(expert_parallel.all_to_all_single_autograd, dispatched, 0)
    expert_parallel.all_to_all_single = counting(expert_parallel.all_to_all_single, counts, 1)
    out: dict = {"rank": rank}
    for name, kwargs in (("ep2_bf16", dict(fsdp_size=2, ep_size=2, fsdp_mixed_precision=True)),
                         ("ep1_fp32", dict(fsdp_size=2))):
        model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(**kwargs),
                                                     dtype=torch.float32)
        shapes = {}
        for pname, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            shapes[pname] = {"full": list(param.shape), "local": list(local.shape),
                             "dtype": str(local.dtype), "dtensor": hasattr(param, "to_local")}
        torch.manual_seed(1 + rank)  # each rank its own batch, as data parallelism gives it
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ledger = CommLedger()
        dispatched.clear()
        counts.clear()
        with ledger.counting():
            ledger.begin()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            step = ledger.close_step(1)
        out[name] = {"shapes": shapes, "comm": step.as_dict(), "dispatch_forward_bytes": sum(dispatched),
                     "dispatch_forward_calls": len(dispatched), "counts_bytes": sum(counts),
                     "counts_calls": len(counts), "loss": float(loss.detach())}
        del model, optimizer
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
