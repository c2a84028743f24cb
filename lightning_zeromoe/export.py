"""``zeromoe-export`` / ``python -m lightning_zeromoe.export``: a ZeroMoEStrategy checkpoint -> a
Hugging Face model directory (or one safetensors file) with the model's own parameter names.

    zeromoe-export CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--dtype auto|float32|bfloat16|float16]
    zeromoe-export CKPT_DIR OUT.safetensors          # one file

Exit status: 0 written; 2 refused or failed (one line on stderr, ``[<knowledge-base id>] ...``,
naming the problem and the fix): bad input, an output path export may not write, a full disk.

OUT is never the checkpoint, inside it or above it, and ``--overwrite`` replaces only an earlier
export (a directory holding ``zeromoe_export.json``, or a ``.safetensors`` file this tool wrote).
Files are written into ``.OUT.zeromoe-tmp-XXXXXXXX/`` beside OUT and renamed into place when
complete; a killed run leaves only that directory, which the next run to the same OUT removes.
"""

from __future__ import annotations

import argparse
import sys

from lightning_zeromoe import invocation
from lightning_zeromoe.checkpoint import DEFAULT_MAX_SHARD_SIZE, ExportError, export

EXIT_BAD_INPUT = 2


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Every option of ``zeromoe-export``; ``prog`` defaults to the name it was started by."""
    parser = argparse.ArgumentParser(
        prog=prog or invocation.prog("zeromoe-export"),
        description="Turn a checkpoint written by ZeroMoEStrategy (DeepSpeed ZeRO 1/2/3, AutoEP) into a Hugging "
                    "Face model directory (config.json, sharded safetensors, index) that from_pretrained loads, "
                    "or one .safetensors file. The checkpoint is only read.")
    parser.add_argument("ckpt_dir", help="directory written by trainer.save_checkpoint(...) / ModelCheckpoint")
    parser.add_argument("out", help="output directory to create (or an empty one), or a path ending in "
                                    ".safetensors for one file; not the checkpoint, inside it or above it")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest output shard, e.g. 5GB (default), 500MB")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto (default): the dtype the model trained in; float32: the fp32 master weights")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="allow unpickling objects other than tensors and known DeepSpeed/Lightning values; "
                             "this can run code from the checkpoint, use it only for checkpoints you trust")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export at OUT (a directory holding zeromoe_export.json and only "
                             "the files it lists, or a .safetensors file zeromoe-export wrote); anything else at OUT "
                             "is refused")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    invocation.help_when_empty(parser, argv)
    args = parser.parse_args(argv)
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    try:
        export(args.ckpt_dir, args.out, dtype=args.dtype, max_shard_size=size, overwrite=args.overwrite,
               trust_checkpoint=args.trust_checkpoint, progress=not args.quiet)
    except ExportError as err:
        print(f"zeromoe-export: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
