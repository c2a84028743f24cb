"""A diagnostic assistant for DeepSpeed ZeRO-3 + MoE training (doctor, lint, explain, Jupyter).

Importing this package loads no torch, deepspeed, lightning or transformers.
"""

__version__ = "0.1.0"
