"""Where the MoE blocks are: structure, Hugging Face semantics, expert lists, patterns.

:func:`discover` (in :mod:`.find`) is the entry point; it returns a :class:`Discovery` (:mod:`.result`).
"""

from lightning_zeromoe.discovery.find import Discovery, MoEPattern, discover

__all__ = ["Discovery", "MoEPattern", "discover"]
