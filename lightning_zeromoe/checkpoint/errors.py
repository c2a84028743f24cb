"""The one exception export raises, and the knowledge-base ids its messages start with."""

from __future__ import annotations

from lightning_zeromoe.knowledge import entry_of

#: Entry ids (``lightning_zeromoe/knowledge/entries/<id>.toml``) of the errors export raises.
NOT_A_CHECKPOINT = "export-not-a-checkpoint"
SHARDS_MISMATCH = "export-shards-mismatch"
SHARD_CORRUPT = "export-shard-corrupt"
UNTRUSTED_OBJECT = "export-untrusted-object"
OUTPUT_PATH = "export-output-path"
META_VERSION = "export-meta-version"
UNSUPPORTED_MODEL = "export-unsupported-model"
BAD_DTYPE = "export-dtype"
DISK_FULL = "export-disk-full"


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message names the problem and the fix.

    ``message`` is ``knowledge.say(entry_id, ...)``: it starts with ``[<entry_id>] `` (the
    knowledge-base entry that explains it), which ``entry_id`` holds.
    """

    def __init__(self, message: str) -> None:
        self.entry_id = entry_of(message)
        super().__init__(message)


def short_list(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``: names in an error message without flooding it."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
