"""Turn shaders/<name>.wgsl into WGSL source: constants injected at pipeline build, libraries imported.

A kernel file may contain lines `#import <lib>`; they are replaced by shaders/<lib>.wgsl. The library
`reduce` resolves to `reduce_subgroup` when the device runs subgroup ops, else `reduce_workgroup`.
"""

from __future__ import annotations

import re

from engine.resources import shader_path

_IMPORT = re.compile(r"^#import\s+(\w+)\s*$", re.M)


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
    seen: set[str] = set()

    def expand(lib: str) -> str:
        if lib == "reduce":
            lib = "reduce_subgroup" if gpu.use_subgroups else "reduce_workgroup"
        if lib in seen:
            return ""
        seen.add(lib)
        text = shader_path(lib).read_text()
        return _IMPORT.sub(lambda m: expand(m.group(1)), text)

    body = expand(name)
    return f"enable f16;\n// ---- constants injected at pipeline build ----\n{const_block(consts)}\n\n{body}"
