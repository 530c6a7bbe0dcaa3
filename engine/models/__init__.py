"""Architectures, one file per family (mlx-lm style), found by scanning this package.

Each architecture file declares MODEL_TYPES (the config.json model_type values it reads), FORMATS (the
checkpoint formats it runs from), GGUF_ARCH (llama.cpp's general.architecture, or None), CONV_TEMPLATE,
HF_IGNORED (Hugging Face tensor prefixes outside the text model), ModelArgs (config.json -> arguments),
spec(args) (what the runtime builds, layer blocks included) and weights(spec) (engine/models/weights.py: every
weight's tensors in every format). Adding an architecture is adding its file (and catalog entries).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from types import ModuleType

from engine.errors import UnsupportedModelError

_SHARED = {"base", "weights"}  # modules of this package that are not architectures


@cache
def architectures() -> dict[str, ModuleType]:
    """model_type -> its architecture module, for every file in this package."""
    out = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _SHARED or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for model_type in module.MODEL_TYPES:
            out[model_type] = module
    return out


def supported() -> tuple[str, ...]:
    return tuple(architectures())


def model_module(model_type: str | None, where: str = "config") -> ModuleType:
    """The architecture module reading configs of `model_type`."""
    module = architectures().get(model_type) if isinstance(model_type, str) else None
    if module is None:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not supported (supported: "
                                    f"{', '.join(architectures())})")
    return module


def gguf_model_type(arch: str, where: str = "GGUF file") -> str:
    """The model_type whose architecture file reads GGUF files of general.architecture `arch`."""
    found = {m.GGUF_ARCH: m.MODEL_TYPES[0] for m in architectures().values() if m.GGUF_ARCH}
    if arch not in found:
        raise UnsupportedModelError(f"{where}: architecture {arch!r} (general.architecture) is not supported; "
                                    f"supported: {', '.join(found)}")
    return found[arch]


_FORMAT_NAMES = {"mlc": "MLC", "mlx": "MLX", "gguf": "GGUF"}


def format_support(model_type: str, fmt: str) -> str | None:
    """None when the engine runs checkpoints of `model_type` in format `fmt` ("mlc", "mlx", "gguf"), else why not."""
    if model_type not in architectures():
        return f"model_type {model_type!r} is not supported yet (supported: {', '.join(architectures())})."
    if fmt in architectures()[model_type].FORMATS:
        return None
    able = [t for t, m in architectures().items() if fmt in m.FORMATS]
    return (f"{_FORMAT_NAMES.get(fmt, fmt)} checkpoints of model_type {model_type!r} are not supported yet (those of "
            f"{', '.join(able) or 'no architecture'} are).")


def __getattr__(name: str):
    if name == "SUPPORTED":  # every model_type, computed on first use (importing the architectures)
        return supported()
    raise AttributeError(name)
