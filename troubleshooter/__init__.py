"""A diagnostic assistant for DeepSpeed ZeRO-3 + MoE training (doctor, lint, explain, Jupyter).

Importing this package loads no torch, deepspeed, lightning or transformers.
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):  # noqa: ANN001, ANN201 - IPython's extension protocol
    """``%load_ext troubleshooter``: registers ``%doctor``, ``%ds_lint``, ``%%troubleshoot`` and the
    automatic diagnosis of failed cells. Imported here, on demand, so that ``import troubleshooter``
    loads neither IPython nor ipywidgets."""
    from troubleshooter.ipython import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):  # noqa: ANN001, ANN201
    """``%unload_ext troubleshooter``: removes everything loading added."""
    from troubleshooter.ipython import unload_ipython_extension as unload

    unload(ipython)
