"""Every private name of torch, DeepSpeed, Lightning and transformers this project touches.

One module per library (:mod:`.torch`, :mod:`.deepspeed`, :mod:`.lightning`,
:mod:`.transformers`); nothing else in ``lightning_zeromoe`` or ``troubleshooter`` reaches into a
library's private names (``tests/test_private_api.py`` finds every such access by AST and fails
on one outside this package). Each module lists what it touches in ``NAMES`` and reports, in
``missing()``, the ones the installed version lacks, so an upgrade that renames one fails loudly,
by name, in that test and in :func:`missing`, instead of silently changing what our checks see.
"""

from __future__ import annotations

from lightning_zeromoe._private import deepspeed, lightning, torch, transformers

_LIBRARIES = (torch, deepspeed, lightning, transformers)

#: Every underscore name the modules of this package touch.
NAMES: frozenset[str] = frozenset(name for library in _LIBRARIES for name in library.NAMES)


def missing() -> list[str]:
    """Private names we rely on that the installed libraries lack (empty when all are there)."""
    return [name for library in _LIBRARIES for name in library.missing()]


__all__ = ["NAMES", "deepspeed", "lightning", "missing", "torch", "transformers"]
