"""Fine-tune a pretrained Hugging Face MoE on a text file with ZeRO-3 + expert parallelism, then export it.

    python examples/quickstart.py                  # Qwen/Qwen3-30B-A3B on 8 GPUs, bf16
    MODEL=/path/to/model TEXT=my.txt python examples/quickstart.py

Settings come from environment variables; the defaults are the 8-GPU job. Without GPUs, the same file
runs on 2 CPU processes with a small local model (as CI runs it):
    MODEL=tiny-moe ACCELERATOR=cpu DEVICES=2 EP_SIZE=2 PRECISION=32-true SEQ=64 MAX_STEPS=4 \
    python examples/quickstart.py
"""
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_zeromoe import ZeroMoEStrategy
from lightning_zeromoe.checkpoint import export  # the function behind the zeromoe-export command

env = os.environ.get
MODEL, TEXT, OUT = env("MODEL", "Qwen/Qwen3-30B-A3B"), env("TEXT", "examples/data/moe_notes.txt"), env("OUT", "runs/qs")
ACCELERATOR, DEVICES, EP_SIZE = env("ACCELERATOR", "gpu"), int(env("DEVICES", 8)), int(env("EP_SIZE", 8))
PRECISION, MAX_STEPS = env("PRECISION", "bf16-true"), int(env("MAX_STEPS", 500))
SEQ, LR = int(env("SEQ", 512)), float(env("LR", 1e-5))  # tokens per sequence, learning rate
VAL_SEQUENCES = 8  # the first 8 sequences of the text are held out for validation


def sequences(tokenizer) -> torch.Tensor:
    """The text file as token ids, cut into [N, SEQ] rows."""
    ids = torch.tensor(tokenizer(open(TEXT).read())["input_ids"])
    return ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)


class FineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self):  # runs once the strategy is set up: each rank loads only its shards
        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(MODEL)
            self.model.gradient_checkpointing_enable()  # activation checkpointing ...
            self.model.train()  # ... which runs only in train mode; from_pretrained returns eval mode

    def training_step(self, batch):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch):
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


if __name__ == "__main__":
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    data = sequences(tokenizer)
    val, train = data[:VAL_SEQUENCES], data[VAL_SEQUENCES:]
    checkpoint = ModelCheckpoint(dirpath=f"{OUT}/checkpoints", monitor="val_loss")  # keeps the best
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=DEVICES, strategy=ZeroMoEStrategy(ep_size=EP_SIZE),
                        precision=PRECISION, max_steps=MAX_STEPS, val_check_interval=min(100, MAX_STEPS),
                        check_val_every_n_epoch=None, callbacks=[checkpoint])
    trainer.fit(FineTune(), torch.utils.data.DataLoader(train, shuffle=True), torch.utils.data.DataLoader(val))
    if trainer.is_global_zero:
        print(f"best val_loss {checkpoint.best_model_score.item()!r} at {checkpoint.best_model_path}")
        export(checkpoint.best_model_path, f"{OUT}/model", overwrite=True)  # = zeromoe-export CKPT OUT/model
        model = AutoModelForCausalLM.from_pretrained(f"{OUT}/model")  # a plain Hugging Face model now
        prompt = tokenizer("Expert parallelism", return_tensors="pt")
        print(tokenizer.decode(model.generate(**prompt, max_new_tokens=20)[0]))
