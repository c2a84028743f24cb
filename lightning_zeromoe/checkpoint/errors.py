"""The one exception export raises, and the knowledge-base ids its messages start with."""

from __future__ import annotations

#: Entry ids (``troubleshooter/knowledge/entries/<id>.toml``) of the errors export raises.
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

    The message starts with ``[<entry_id>] `` (the knowledge-base entry that explains it).
    """

    def __init__(self, entry_id: str, message: str) -> None:
        self.entry_id = entry_id
        super().__init__(f"[{entry_id}] {message}")


def short_list(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``: names in an error message without flooding it."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
