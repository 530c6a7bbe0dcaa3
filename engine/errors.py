"""Errors the user can act on. Each carries a plain message naming the file, tensor or field at fault."""


class ZeroTVMError(Exception):
    """Base class: the CLI and the app show str(error) instead of a traceback."""


class GpuError(ZeroTVMError):
    """No usable GPU adapter, a missing feature, or a limit the model exceeds."""


class ModelFormatError(ZeroTVMError):
    """A model folder or file is missing, corrupt, or not what its manifest says."""


class UnsupportedModelError(ModelFormatError):
    """The checkpoint is readable but its architecture is not one we run."""
