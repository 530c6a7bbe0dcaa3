"""Turn shaders/<name>.wgsl into WGSL source: constants injected at pipeline build, libraries imported.

A kernel file may contain lines `#import <lib>`; they are replaced by shaders/<lib>.wgsl (engine.kernels.expand).
The library `reduce` resolves to `reduce_subgroup` when the device runs subgroup ops, else `reduce_workgroup`.
"""

from __future__ import annotations

import re

from engine.kernels import expand

# Constants that describe the model, not one kernel: the runtime gives every kernel of a model that reads one the
# model's value (engine/gpu.py ModelGpu); a kernel built on its own (tests, probes) takes the value here.
# Q8_NATURAL: int8 activation rows in element order (q8_codes.wgsl), for models whose int8 products all read GGUF
# K-quant blocks; else matvec_q8's order.
MODEL_CONSTANTS: dict[str, bool] = {"Q8_NATURAL": False}


def with_model_constants(source: str, consts: dict, model: dict | None = None) -> dict:
    """`consts` plus the MODEL_CONSTANTS `source` reads and `consts` leaves out: `model`'s value, else the default."""
    out = dict(consts)
    for name, default in MODEL_CONSTANTS.items():
        if name not in out and re.search(rf"\b{name}\b", source):
            out[name] = (model or {}).get(name, default)
    return out


def const_block(consts: dict) -> str:
    lines = []
    for name, value in consts.items():
        if isinstance(value, bool):
            lines.append(f"const {name}: bool = {str(value).lower()};")
        elif isinstance(value, int):
            if value < 0:
                raise ValueError(f"shader constant {name} must be ≥ 0, got {value}")
            lines.append(f"const {name}: u32 = {value}u;")
        elif isinstance(value, float):
            lines.append(f"const {name}: f32 = {value!r};")
        else:
            raise TypeError(f"shader constant {name} has unsupported type {type(value).__name__}")
    return "\n".join(lines)


def build_source(name: str, consts: dict, gpu) -> str:
    body = expand(name, "reduce_subgroup" if gpu.use_subgroups else "reduce_workgroup")
    return f"enable f16;\n// ---- constants injected at pipeline build ----\n{const_block(consts)}\n\n{body}"
