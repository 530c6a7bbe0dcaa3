"""Errors the user can act on. Each carries a plain message naming the file, tensor or field at fault."""


class ZeroTVMError(Exception):
    """Base class: the CLI and the app show str(error) instead of a traceback."""


class GpuError(ZeroTVMError):
    """No usable GPU adapter, a missing feature, or a limit the model exceeds."""


class WeightsBudgetError(GpuError):
    """The weights budget (--gpu-weights, ZEROTVM_GPU_WEIGHTS, Settings) is below what the model needs on the GPU."""


class BudgetSpellingError(ZeroTVMError, ValueError):
    """A weights budget that is not a size (or is no size a GPU has): a ValueError too, as other bad options."""


class ModelFormatError(ZeroTVMError):
    """A model folder or file is missing, corrupt, or not what its manifest says."""


class UnsupportedModelError(ModelFormatError):
    """The checkpoint is readable but its architecture is not one we run."""


class ContextLimitError(ZeroTVMError):
    """A prompt that does not fit the context window; carries the numbers for the UI."""

    def __init__(self, used: int, limit: int, reserve: int = 0):
        self.used, self.limit, self.reserve = used, limit, reserve
        needs = f"{used} tokens plus {reserve} for the reply" if reserve else f"{used} tokens"
        super().__init__(
            f"the conversation needs {needs} but the context holds {limit}; start a new chat, "
            "shorten it, or allow dropping the oldest turns"
        )
