"""``python -m lightning_zeromoe.planner`` (the ``zeromoe-plan`` command): see :mod:`lightning_zeromoe.planner.cli`."""

from lightning_zeromoe.planner.cli import main

if __name__ == "__main__":
    main()
