"""``zeromoe-export`` / ``python -m lightning_zeromoe.export``: a ZeRO-3 + AutoEP checkpoint -> one
safetensors file with the model's own parameter names.

    python -m lightning_zeromoe.export CKPT_DIR OUT.safetensors [--dtype auto|float32|bfloat16|float16]

Exit status: 0 written; 2 bad input (one line on stderr naming the problem and the fix).
"""

from __future__ import annotations

import argparse
import sys

from lightning_zeromoe.checkpoint import ExportError, export

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeromoe-export",
        description="Turn a checkpoint written by ZeroMoEStrategy (DeepSpeed ZeRO-3 + AutoEP) into one "
                    "safetensors state dict with the model's own parameter names (for load_state_dict / "
                    "from_pretrained). The checkpoint is only read.")
    parser.add_argument("ckpt_dir", help="directory written by trainer.save_checkpoint(...) / ModelCheckpoint")
    parser.add_argument("out", help="the .safetensors file to write (outside the checkpoint directory)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto (default): the dtype the model trained in; float32: the fp32 master weights")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        export(args.ckpt_dir, args.out, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet)
    except ExportError as err:
        print(f"zeromoe-export: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
