"""Progress for long exports: lines on stderr, and a rich bar with bytes written, speed and ETA."""

from __future__ import annotations

import sys
from typing import Any, Callable


class _Bar:
    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, nbytes)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


class Progress:
    """``progress=True``: lines and a bar on stderr; a callable: lines only; False: nothing."""

    def __init__(self, progress: bool | Callable[[str], None]) -> None:
        self._say: Callable[[str], None]
        if callable(progress):
            self._say, self._bars = progress, False
        elif progress:
            self._say, self._bars = (lambda s: print(f"[zeromoe-export] {s}", file=sys.stderr, flush=True)), True
        else:
            self._say, self._bars = (lambda s: None), False

    def line(self, text: str) -> None:
        self._say(text)

    def bar(self, total_bytes: int, description: str) -> _Bar:
        if not self._bars:
            return _Bar(None, None)
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        bar = RichProgress(TextColumn("\\[zeromoe-export] writing {task.description}"), BarColumn(), DownloadColumn(),
                           TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                           transient=False)
        task = bar.add_task(description, total=total_bytes)
        bar.start()
        return _Bar(bar, task)
