"""Where an export goes, and how it gets there without removing anything export did not write.

Rules (``zeromoe-export`` never removes what it did not write):

* OUT may not be the checkpoint, a path inside it, or a directory that holds it (compared after
  resolving symbolic links).
* An existing OUT is replaced (``overwrite=True``) only when an earlier export wrote it: a
  directory with the marker ``zeromoe_export.json`` and nothing the marker does not list, or a
  ``.safetensors`` file whose header names this exporter as its producer. An empty directory is
  used as it is; anything else is refused, with or without ``overwrite``.
* Files are written into ``.<name>.zeromoe-tmp-XXXXXXXX/new/`` beside OUT (the same filesystem),
  flushed to disk, the marker last; then ``new/`` is renamed to OUT. An earlier export is first
  renamed into the work directory and removed with it. A killed export leaves only its work
  directory: the next export to the same OUT sees that no process holds the work directory's
  ``lock`` (an ``flock``, released by the kernel when its process dies) and removes it.
* Files get the mode a plain ``open(path, "w")`` gets there (the umask): safetensors' own writer
  renames a private temporary file (mode 0600) into place, which would hide the weights from
  the group on a shared filesystem.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lightning_zeromoe.checkpoint.errors import DISK_FULL, OUTPUT_PATH, ExportError, short_list
from lightning_zeromoe import knowledge
from lightning_zeromoe.knowledge import say

try:  # Unix; without it (Windows) a leftover work directory is reported, never removed
    import fcntl
except ImportError:  # pragma: no cover - exercised by tests/test_portability.py
    fcntl = None  # type: ignore[assignment]

MARKER_FILE = "zeromoe_export.json"
MARKER_FORMAT = "lightning_zeromoe/export"
MARKER_VERSION = 1
#: ``__metadata__["producer"]`` of every safetensors file export writes.
PRODUCER = "lightning_zeromoe.export"
WORK_TAG = ".zeromoe-tmp-"
_LOCK, _NEW, _OLD = "lock", "new", "old"
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
#: What exports written before the marker listed its files may hold.
_LEGACY_FILES = re.compile(r"(config|generation_config|model\.safetensors\.index)\.json"
                           r"|model(-\d+-of-\d+)?\.safetensors|adapter/adapter_(model\.safetensors|config\.json)")
#: A work directory without its lock file is in its first instant (or its export died then).
_UNLOCKED_GRACE_S = 60.0


def real(path: str | os.PathLike) -> Path:
    """The absolute path with every symbolic link resolved (the parts that exist)."""
    return Path(os.path.realpath(path))


def check_location(out: Path, ckpt_dir: Path) -> None:
    """Refuse an OUT that is the checkpoint, inside it, or above it, or whose parent is missing."""
    final, ckpt = real(out), real(ckpt_dir)
    if final == ckpt or ckpt in final.parents:
        raise ExportError(say(OUTPUT_PATH, "inside-checkpoint", "path-outside", out=out, ckpt_dir=ckpt_dir))
    if final in ckpt.parents:
        raise ExportError(say(OUTPUT_PATH, "contains-checkpoint", "new-directory", out=out, ckpt=ckpt))
    if not final.parent.is_dir():
        raise ExportError(say(OUTPUT_PATH, "no-parent", "create-parent", parent=out.parent))


def check_existing(out: Path, overwrite: bool) -> None:
    """Refuse an existing OUT that export may not replace; ``overwrite`` allows an earlier export."""
    final = real(out)
    if not os.path.lexists(final):
        return
    if out.suffix == ".safetensors":
        if not final.is_file():
            raise ExportError(say(OUTPUT_PATH, "not-a-file", "another-path", out=out))
        if not written_by_export(final):
            raise ExportError(say(OUTPUT_PATH, "foreign-file", "another-or-move-file", out=out,
                                  producer=PRODUCER))
    else:
        if not final.is_dir():
            raise ExportError(say(OUTPUT_PATH, "not-a-directory", "another-path", out=out))
        if not any(final.iterdir()):
            return  # an empty directory: nothing to lose
        marker = read_marker(final)
        if marker is None:
            raise ExportError(say(OUTPUT_PATH, "foreign-directory", "new-or-empty", out=out,
                                  marker_file=MARKER_FILE))
        foreign = foreign_entries(final, marker)
        if foreign:
            raise ExportError(say(OUTPUT_PATH, "foreign-files", "move-files-out", out=out, count=len(foreign),
                                  names=short_list(foreign)))
    if not overwrite:
        raise ExportError(say(OUTPUT_PATH, "exists", "another-or-overwrite", out=out))


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The parsed marker of an export directory, or None when it has none (or not a JSON object)."""
    try:
        data = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def foreign_entries(directory: Path, marker: dict[str, Any]) -> list[str]:
    """Paths under ``directory`` (relative, sorted) that the marker does not account for.

    A marker with a ``files`` list names every file its export wrote; an older marker without one
    allows the names export has always used. Symbolic links and directories holding none of the
    listed files count as foreign too.
    """
    listed = marker.get("files")
    names = set(listed) if isinstance(listed, (dict, list)) else None
    allowed_dirs = {str(p) for n in (names or ("adapter/x",)) for p in Path(n).parents if str(p) != "."}
    foreign = []
    for root, dirs, files in os.walk(directory):
        base = Path(root).relative_to(directory)
        for name in sorted(dirs):
            rel = str(base / name)
            if os.path.islink(os.path.join(root, name)) or rel not in allowed_dirs:
                foreign.append(rel + "/")
                dirs.remove(name)
        for name in files:
            rel = str(base / name)
            if rel == MARKER_FILE:
                continue
            known = rel in names if names is not None else bool(_LEGACY_FILES.fullmatch(rel))
            if not known or os.path.islink(os.path.join(root, name)):
                foreign.append(rel)
    return sorted(foreign)


def written_by_export(path: Path) -> bool:
    """Whether ``path`` is a safetensors file whose header metadata names this exporter."""
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= 100_000_000:
                return False
            header = json.loads(handle.read(size))
    except (OSError, ValueError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get("producer") == PRODUCER


def disk_full(err: BaseException, out: Path, needed_bytes: int) -> ExportError | None:
    """The one-line error for a write that failed for lack of space (or a file-size limit or
    quota), or None for any other failure. safetensors reports it as ``... (os error 28)``."""
    code = getattr(err, "errno", None)
    if code is None and (found := re.search(r"\(os error (\d+)\)", str(err))):
        code = int(found.group(1))
    if code not in _DISK_FULL_ERRNOS:
        return None
    return ExportError(say(DISK_FULL, "write-failed", "free-space-or-elsewhere", out=out,
                           reason=os.strerror(code), code=errno.errorcode[code], parent=real(out).parent,
                           megabytes=needed_bytes / 1e6))


class Staging:
    """The private work directory beside OUT that an export writes into, then publishes."""

    def __init__(self, out: Path, *, overwrite: bool, say: Callable[[str], None]) -> None:
        self.out, self.final, self.overwrite, self._say = out, real(out), overwrite, say
        self.single = out.suffix == ".safetensors"
        self.work: Path | None = None
        self.file_mode = 0o644
        self._lock: int | None = None

    @property
    def new(self) -> Path:
        """Where the export writes: becomes OUT (a directory), or holds the one file."""
        assert self.work is not None, "open() first"
        return self.work / _NEW

    def sweep(self) -> None:
        """Remove the work directories that killed exports to the same OUT left behind; refuse
        while another export to it is running."""
        prefix = f".{self.final.name}{WORK_TAG}"
        for entry in sorted(self.final.parent.iterdir()):
            if not entry.name.startswith(prefix) or entry.is_symlink() or not entry.is_dir():
                continue
            state, owner = _probe(entry)
            if state == "live":
                raise ExportError(say(OUTPUT_PATH, "locked", "wait-or-another", owner=owner, out=self.out,
                                      entry=entry))
            if state == "unknown":
                self._say(knowledge.message(OUTPUT_PATH, "left-in-place").render(entry=entry))
                continue
            old = entry / _OLD
            if old.is_dir() and not os.path.lexists(self.final):
                os.rename(old, self.final)  # killed between moving the earlier export aside and renaming in
                self._say(f"put back the earlier export at {self.out}, which a killed export had moved to {old}")
            shutil.rmtree(entry)
            self._say(f"removed {entry}: what an export of {self.out} ({owner}) left when it was killed or crashed")

    def open(self) -> Path:
        """Create the work directory, take its lock, and return where to write."""
        try:
            self.work = Path(tempfile.mkdtemp(prefix=f".{self.final.name}{WORK_TAG}", dir=self.final.parent))
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise ExportError(say(OUTPUT_PATH, "unwritable", "writable-path", parent=self.out.parent,
                                  strerror=err.strerror)) from None
        self._lock = os.open(self.work / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if fcntl is not None:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no locks on this filesystem: a later export cannot tell this one from a dead one
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.write(self._lock, json.dumps(owner).encode())
        self.new.mkdir()
        probe = self.new / ".mode-probe"
        with open(probe, "w"):
            pass
        self.file_mode = stat.S_IMODE(probe.stat().st_mode)
        probe.unlink()
        return self.new

    def commit(self, marker: dict[str, Any] | None) -> None:
        """Give every file the umask's mode, flush it, write the marker (a directory export) last,
        and rename the result to OUT; then remove the work directory (and an earlier export)."""
        files: dict[str, int] = {}
        for path in sorted(self.new.rglob("*")):
            if path.is_file():
                os.chmod(path, self.file_mode)
                _fsync(path)
                files[str(path.relative_to(self.new))] = path.stat().st_size
        check_existing(self.out, self.overwrite)  # OUT may have changed during a long export
        if self.single:
            [name] = files
            os.replace(self.new / name, self.final)
        else:
            with open(self.new / MARKER_FILE, "w") as handle:
                json.dump({**(marker or {}), "files": files}, handle, indent=2)
                handle.flush()
                os.fsync(handle.fileno())
            for directory in [self.new, *(p for p in self.new.rglob("*") if p.is_dir())]:
                _fsync(directory)
            self._publish_dir()
        _fsync(self.final.parent)
        self.close()

    def _publish_dir(self) -> None:
        if os.path.lexists(self.final) and any(self.final.iterdir()):
            os.rename(self.final, self.work / _OLD)  # an earlier export, checked just now
            try:
                os.rename(self.new, self.final)
            except OSError:
                os.rename(self.work / _OLD, self.final)
                raise
        else:
            os.rename(self.new, self.final)  # replaces an empty directory too

    def abort(self) -> None:
        """Remove the work directory after a failure, putting an earlier export back if needed."""
        if self.work is not None and (self.work / _OLD).is_dir() and not os.path.lexists(self.final):
            os.rename(self.work / _OLD, self.final)
        self.close()

    def close(self) -> None:
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _probe(work: Path) -> tuple[str, str]:
    """``("live" | "stale" | "unknown", who started it)`` for another export's work directory."""
    try:
        fd = os.open(work / _LOCK, os.O_RDWR)
    except FileNotFoundError:
        young = time.time() - work.stat().st_mtime < _UNLOCKED_GRACE_S
        return ("live" if young else "stale"), "owner unknown"
    try:
        try:
            owner = json.loads(os.read(fd, 4096) or b"{}")
            who = f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
        except (ValueError, KeyError, TypeError):
            who = "owner unknown"
        if fcntl is None:
            return "unknown", who
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "live", who
        except OSError:
            return "unknown", who
        return "stale", who
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk (a directory only where the filesystem allows it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if not path.is_dir() or err.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
