"""Real logs shipped with the troubleshooter, to try ``troubleshooter explain --example NAME`` on.

Each ``NAME.txt`` is a verbatim excerpt whose first line names its source; ``cuda_oom`` is a CUDA
out-of-memory error under ZeRO-3 from a public issue (the same file as the test fixture
``tests/fixtures/tracebacks/issue_cuda_oom_new_format.txt``; ``tests/test_cli.py`` compares them).
"""

from __future__ import annotations

from importlib import resources


def names() -> list[str]:
    """The bundled examples, by name."""
    return sorted(p.name.removesuffix(".txt") for p in resources.files(__name__).iterdir() if p.name.endswith(".txt"))


def path(name: str) -> str:
    """The file of example ``name`` (an installed package is a directory on disk, as pip installs it)."""
    return str(resources.files(__name__) / f"{name}.txt")


__all__ = ["names", "path"]
