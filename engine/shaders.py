"""Turn shaders/<name>.wgsl into WGSL source: constants injected at pipeline build, libraries imported.

A kernel file may contain lines `#import <lib>`; they are replaced by shaders/<lib>.wgsl (engine.kernels.expand).
The library `reduce` resolves to `reduce_subgroup` when the device runs subgroup ops, else `reduce_workgroup`.
"""

from __future__ import annotations

from engine.kernels import expand


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
