"""Kernels described once: each WGSL file's interface read from its own declarations.

A `Kernel` parses shaders/<name>.wgsl (its `#import`s expanded): the `@group(0) @binding(n) var<storage, access> name`
and `var<uniform> name: Struct` declarations, and the uniform structs' fields. The host side binds buffers and
writes uniform fields by those names, so a mismatch is a load-time error that names both sides (the shader file
and the host's name or field) instead of a silent misbinding by position. The host side also declares which
bindings it expects the kernel to write (`writes`); a WGSL file that disagrees is refused when first used.

The modules next to this one hold each kernel family's host side (constants and grids: its "plan") beside the
`Kernel` it plans for: matmul (matvecs, GEMMs, quantize, embedding), norm, attention, gdn, moe, sampling.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from engine.resources import shader_path

_IMPORT = re.compile(r"^#import\s+(\w+)\s*$", re.M)
_COMMENT = re.compile(r"//[^\n]*")
_BINDING = re.compile(r"@group\(\s*0\s*\)\s*@binding\(\s*(\d+)\s*\)\s*var\s*<\s*(storage|uniform)\s*(?:,\s*(\w+)\s*)?>"
                      r"\s*(\w+)\s*:\s*([^;]+);")
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{([^}]*)\}")
_FIELD = re.compile(r"(\w+)\s*:\s*([\w<>]+)\s*,?")
# Host-shareable uniform field types: size and alignment in bytes (WGSL's layout rules for these types).
_UNIFORM_TYPES = {"u32": (4, 4, np.uint32), "i32": (4, 4, np.int32), "f32": (4, 4, np.float32)}


MAX_GROUPS_PER_DIM = 65535  # WebGPU's default limit on workgroups per grid dimension


def fold_grid(groups: int) -> tuple[int, int]:
    """Split a 1-D workgroup count into (x, y) so each is ≤ 65,535; kernels rebuild id = y*nx + x."""
    if groups <= MAX_GROUPS_PER_DIM:
        return max(groups, 1), 1
    y = -(-groups // MAX_GROUPS_PER_DIM)
    x = -(-groups // y)
    return x, y


def row_outputs(kernel: str, rows_q8: bool, rows_f32: bool | None) -> dict:
    """ROWS_F32 / ROWS_Q8 of a kernel that writes its output rows as f32, as int8 (the next int8 product's input, as
    quantize_q8 writes it) or both; `rows_f32` None: f32 exactly when not int8."""
    rows_f32 = not rows_q8 if rows_f32 is None else rows_f32
    if not (rows_q8 or rows_f32):
        raise ValueError(f"{kernel} must write its rows as f32, int8 or both")
    return dict(ROWS_F32=bool(rows_f32), ROWS_Q8=bool(rows_q8))


class KernelInterfaceError(ValueError):
    """A host/kernel mismatch: a binding or uniform field one side names and the other does not have."""


def expand(name: str, reduce_lib: str = "reduce_workgroup") -> str:
    """shaders/<name>.wgsl with its `#import`s inlined once each (`reduce` resolves to `reduce_lib`)."""
    seen: set[str] = set()

    def inline(lib: str) -> str:
        if lib == "reduce":
            lib = reduce_lib
        if lib in seen:
            return ""
        seen.add(lib)
        path = shader_path(lib)
        if not path.is_file():
            raise KernelInterfaceError(f"shaders/{name}.wgsl imports {lib!r}, but shaders/{lib}.wgsl does not exist")
        return _IMPORT.sub(lambda m: inline(m.group(1)), path.read_text())

    return inline(name)


@dataclass(frozen=True)
class Binding:
    index: int
    name: str
    space: str  # "storage" | "uniform"
    access: str  # "read" | "read_write" ("read" for uniforms)
    type: str  # the WGSL type as written


@dataclass(frozen=True)
class UniformStruct:
    """A uniform struct's host layout: field -> (byte offset, numpy dtype), in declaration order."""

    name: str
    file: str
    fields: dict[str, tuple[int, type]]
    size: int

    def pack(self, **values) -> np.ndarray:
        """The struct's bytes with every field set by name (all of them: a uniform is rewritten whole)."""
        unknown = set(values) - set(self.fields)
        missing = set(self.fields) - set(values)
        if unknown or missing:
            raise KernelInterfaceError(
                f"uniform struct {self.name} ({self.file}) has fields {', '.join(self.fields)}; the host "
                + (f"names unknown field(s) {', '.join(sorted(unknown))}" if unknown else "")
                + ("; " if unknown and missing else "")
                + (f"leaves out {', '.join(sorted(missing))}" if missing else ""))
        out = np.zeros(self.size, np.uint8)
        for name, (offset, dtype) in self.fields.items():
            out[offset:offset + 4] = np.array([values[name]], dtype).view(np.uint8)
        return out


def _parse_struct(name: str, body: str, file: str) -> UniformStruct:
    fields, offset, align = {}, 0, 4
    for field, wgsl_type in _FIELD.findall(_COMMENT.sub("", body)):
        if wgsl_type not in _UNIFORM_TYPES:
            raise KernelInterfaceError(f"uniform struct {name} ({file}) field {field}: type {wgsl_type} has no host "
                                       f"layout here (use {', '.join(_UNIFORM_TYPES)})")
        size, a, dtype = _UNIFORM_TYPES[wgsl_type]
        offset = -(-offset // a) * a
        fields[field] = (offset, dtype)
        offset += size
        align = max(align, a)
    return UniformStruct(name, file, fields, max(16, -(-offset // 16) * 16))  # uniform structs round to 16


class Kernel:
    """The interface of shaders/<name>.wgsl. `writes`: the bindings the host expects the kernel to write (checked
    against the declared access when the kernel is first parsed). `source`: WGSL given directly instead of the file
    (bench probes)."""

    def __init__(self, name: str, writes: Sequence[str] = (), source: str | None = None):
        self.name, self.file = name, f"shaders/{name}.wgsl" if source is None else f"<{name}>"
        self.writes = tuple(writes)
        self._checked = False
        self._own = None if source is None else _parse(source, self.file)

    def _parsed(self) -> tuple[str, dict, dict]:
        return self._own or _parsed(self.name)

    @property
    def source(self) -> str:
        return self._parsed()[0]

    @property
    def bindings(self) -> dict[str, Binding]:
        """name -> Binding, in binding order; checked against `writes`."""
        bindings = self._parsed()[1]
        if self._checked:
            return bindings
        for name in self.writes:
            b = bindings.get(name)
            if b is None:
                raise KernelInterfaceError(f"the host expects {self.file} to write binding {name!r}, which it does "
                                           f"not declare (its bindings: {', '.join(bindings)})")
            if b.access != "read_write":
                raise KernelInterfaceError(f"the host expects {self.file} to write binding {name!r}, which it "
                                           f"declares as var<{b.space}, {b.access}>")
        self._checked = True
        return bindings

    def uniform(self, binding: str) -> UniformStruct:
        """The struct behind a uniform binding."""
        b = self.bindings.get(binding)
        if b is None or b.space != "uniform":
            raise KernelInterfaceError(f"{self.file} has no uniform binding {binding!r}")
        return self._parsed()[2][b.type.strip()]

    def check_consts(self, consts: Mapping) -> None:
        """Every constant the host injects must be named in the shader (a misspelt one would be silently unused)."""
        unused = [c for c in consts if not re.search(rf"\b{re.escape(c)}\b", self.source)]
        if unused:
            raise KernelInterfaceError(f"the host sets constant(s) {', '.join(unused)} that {self.file} never uses")

    def entries(self, buffers: Mapping[str, object] | Sequence, label: str) -> list[dict]:
        """Bind group entries for `buffers` (name -> buffer or (buffer, offset, size); a sequence binds in binding
        order), checked against the declarations: every binding once, no unknown name, the right buffer usage."""
        declared = self.bindings
        if not isinstance(buffers, Mapping):
            if len(buffers) != len(declared):
                raise KernelInterfaceError(f"{label}: {self.file} declares {len(declared)} bindings "
                                           f"({', '.join(declared)}); the host gives {len(buffers)}")
            buffers = dict(zip(declared, buffers, strict=True))
        unknown = [n for n in buffers if n not in declared]
        missing = [n for n in declared if n not in buffers]
        if unknown or missing:
            raise KernelInterfaceError(
                f"{label}: {self.file} declares bindings {', '.join(declared)}; the host "
                + (f"binds unknown name(s) {', '.join(unknown)}" if unknown else "")
                + ("; " if unknown and missing else "") + (f"leaves out {', '.join(missing)}" if missing else ""))
        entries = []
        for name, b in declared.items():
            res = buffers[name]
            buf, off, size = res if isinstance(res, tuple) else (res, 0, res.size)
            usage = "UNIFORM" if b.space == "uniform" else "STORAGE"
            if not int(buf.usage) & _usage_bit(usage):
                raise KernelInterfaceError(f"{label}: {self.file} binding {name!r} is var<{b.space}>, but the host's "
                                           f"buffer {buf.label!r} was not created with {usage} usage")
            entries.append({"binding": b.index, "resource": {"buffer": buf, "offset": off, "size": size}})
        return entries

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


def _usage_bit(name: str) -> int:
    import wgpu

    return int(getattr(wgpu.BufferUsage, name))


@cache
def _parsed(name: str) -> tuple[str, dict[str, Binding], dict[str, UniformStruct]]:
    return _parse(expand(name), f"shaders/{name}.wgsl")


def _parse(source: str, file: str) -> tuple[str, dict[str, Binding], dict[str, UniformStruct]]:
    text = _COMMENT.sub("", source)
    bindings: dict[str, Binding] = {}
    for index, space, access, var, wgsl_type in _BINDING.findall(text):
        if var in bindings or any(b.index == int(index) for b in bindings.values()):
            raise KernelInterfaceError(f"{file} declares binding {index} / {var!r} twice")
        bindings[var] = Binding(int(index), var, space, access or "read", wgsl_type.strip())
    if sorted(b.index for b in bindings.values()) != list(range(len(bindings))):
        raise KernelInterfaceError(f"{file}: binding indices {sorted(b.index for b in bindings.values())} are not "
                                   "0..n-1")
    structs = {s: _parse_struct(s, body, file) for s, body in _STRUCT.findall(text)
               if any(b.space == "uniform" and b.type == s for b in bindings.values())}
    for b in bindings.values():
        if b.space == "uniform" and b.type not in structs:
            raise KernelInterfaceError(f"{file}: uniform {b.name!r} has type {b.type}, which is not a struct here")
    return source, dict(sorted(bindings.items(), key=lambda kv: kv[1].index)), structs


_REGISTRY: dict[str, Kernel] = {}
_FAMILIES = tuple(f"engine.kernels.{f}" for f in ("matmul", "norm", "attention", "gdn", "moe", "sampling",
                                                 "expert_cache")) + ("engine.kquant_plan",)


def declare(name: str, writes: Sequence[str] = ()) -> Kernel:
    """A family module's declaration of one of its kernels (the host's expectations), registered by name."""
    if name in _REGISTRY:
        raise KernelInterfaceError(f"kernel {name!r} is declared twice")
    _REGISTRY[name] = k = Kernel(name, writes)
    return k


def kernel(name: str) -> Kernel:
    """The declared Kernel for shaders/<name>.wgsl (a plain one, without host expectations, for an undeclared
    file such as a bench probe's)."""
    if name not in _REGISTRY:
        import importlib

        for family in _FAMILIES:  # declarations live in the family modules; import them on first use
            importlib.import_module(family)
    return _REGISTRY.get(name) or Kernel(name)


@cache
def uniform_struct(lib: str, name: str) -> UniformStruct:
    """A uniform struct declared in a WGSL library (shaders/<lib>.wgsl), e.g. ("step", "Step")."""
    file = f"shaders/{lib}.wgsl"
    for s, body in _STRUCT.findall(_COMMENT.sub("", expand(lib))):
        if s == name:
            return _parse_struct(s, body, file)
    raise KernelInterfaceError(f"{file} declares no struct {name}")


def step_struct() -> UniformStruct:
    """The per-forward `Step` uniform every kernel that binds `step` shares (shaders/step.wgsl)."""
    return uniform_struct("step", "Step")
