"""Zero-TVM engine: Qt-free GPU inference on hand-written WGSL kernels."""

__version__ = "0.1.0"


def load_model(*args, **kwargs):
    """See engine.model.load_model (imported lazily so `import engine` stays light)."""
    from engine.model import load_model as _load

    return _load(*args, **kwargs)
