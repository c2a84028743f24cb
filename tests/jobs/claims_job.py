"""Knowledge-base claims that need an initialised process group, in one CPU process (gloo, world
size 1): start-up is the expensive part, so every such check runs in this one launch.

* ``save16``: does save_16bit_model refuse under AutoEP + ZeRO-3 whatever
  stage3_gather_16bit_weights_on_model_save says? One real engine per flag value (autoep_size 1,
  a tiny Hugging Face Mixtral): {"true": "<exception type>: <message>", "false": ...}.
* ``batch``: what DeepSpeedConfig raises for train_batch_size 16, micro 4 on 8 data-parallel
  ranks (the size comes through DeepSpeed's mpu interface, as Megatron passes it; DeepSpeedConfig
  reads it only once the process group exists).

Prints one JSON line.

    python tests/jobs/claims_job.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
if "MASTER_PORT" not in os.environ:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402


def attempt(gather: bool, out_dir: str) -> str:
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                           num_experts_per_tok=1, max_position_embeddings=32)
    model = MixtralForCausalLM(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": gather},
                 "expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    assert engine._has_autoep_layers(), "AutoEP did not convert the Mixtral block"
    try:
        saved = engine.save_16bit_model(out_dir, f"gather_{gather}.bin")
    except Exception as err:  # noqa: BLE001 - the point is which exception
        return f"{type(err).__name__}: {err}"
    return f"returned {saved!r}"


class DataParallel:
    """DeepSpeed's mpu interface: only the data-parallel size is read by DeepSpeedConfig."""

    def get_data_parallel_world_size(self) -> int:
        return 8


def batch_error(config: dict) -> str:
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(config, mpu=DataParallel())
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "accepted"


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    print(json.dumps({
        "save16": {str(g).lower(): attempt(g, out_dir) for g in (True, False)},
        "batch": {"16/4/8": batch_error({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}),
                  "16/2/1/8": batch_error({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                           "gradient_accumulation_steps": 1})},
    }))


if __name__ == "__main__":
    main()
