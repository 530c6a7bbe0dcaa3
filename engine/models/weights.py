"""Where each weight of the runtime lives in every checkpoint format: the table an architecture file declares.

An architecture's `weights(spec)` lists one `Weight` per canonical weight (the runtime's names: embed, norm,
lm_head, layers.N.qkv, layers.N.moe.gate_up, ...) with its logical shape and its tensors in each format: the
MLC name (mlc-llm's loader names, written by engine/convert.py), the Hugging Face tensors it is made of (read by
the converter), the GGUF tensors (llama.cpp's converter names) and the MLX tensors (mlx-lm's names). Readers,
the converter and load_model derive everything from this table; none of them knows an architecture.

A weight made of several tensors joins their rows in the order listed (q ++ k ++ v = qkv, gate ++ up =
gate_up); an expert stack joins each expert's rows. Where builds of one format differ, the alternatives are
listed in order and the first one present is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

MATRIX = "matrix"  # a linear weight [N, K]: quantized in MLC (<name>.q_weight / .q_scale)
EXPERTS = "experts"  # a stack of expert matrices [E, N, K], quantized in MLC like a matrix
NORM = "norm"  # a 1-D norm weight, f16 in MLC
PARAM = "param"  # any other tensor, kept unquantized in MLC in `dtype` (float32 goes out as bf16 records)


@dataclass(frozen=True)
class GgufPart:
    """One GGUF tensor of a weight: its name, expected rows (None for a vector), and for llama's q/k the head
    count over which llama.cpp's converter permuted the rows (undone on reading)."""

    name: str
    rows: int | None = None
    heads: int | None = None


@dataclass(frozen=True)
class Weight:
    name: str  # the runtime's canonical name
    kind: str  # MATRIX, EXPERTS, NORM or PARAM
    shape: tuple[int, ...]  # logical shape: (N, K), (E, N, K), (D,), or a PARAM's own
    mlc: tuple[str, ...]  # its MLC name, then names other MLC builds use for it
    hf: tuple[str, ...] = ()  # Hugging Face tensors whose rows it joins; "{e}" marks per-expert ones
    hf_fused: str = ""  # EXPERTS: the one [E, N, K] tensor some checkpoints hold instead (transformers 5)
    hf_offset: float = 0.0  # added when converting: the +1 a zero-centred norm gets baked in (as mlc-llm does)
    gguf: tuple[tuple[GgufPart, ...], ...] = ()  # alternatives, each the GGUF tensors whose rows it joins
    mlx: tuple[str, ...] = ()  # MLX tensors whose rows it joins
    dtype: str = "float16"  # NORM/PARAM: the dtype stored in MLC

    @property
    def quantized(self) -> bool:
        """Stored as q_weight/q_scale in MLC."""
        return self.kind in (MATRIX, EXPERTS)

    def mlc_tensors(self, name: str | None = None) -> dict[str, str]:
        """Canonical tensor name -> MLC tensor name (under MLC name `name`, default the first)."""
        base = name or self.mlc[0]
        if self.quantized:
            return {f"{self.name}.{k}": f"{base}.{k}" for k in ("q_weight", "q_scale")}
        return {self.name: base}


def matrix(name: str, shape: tuple[int, int], mlc: str | tuple[str, ...], hf=(), gguf=(), mlx=()) -> Weight:
    return Weight(name, MATRIX, shape, _names(mlc), hf=_names(hf), gguf=_alternatives(gguf), mlx=_names(mlx))


def norm(name: str, size: int, mlc: str, hf: str = "", gguf: str = "", mlx: str = "", hf_offset: float = 0.0
         ) -> Weight:
    return Weight(name, NORM, (size,), (mlc,), hf=_names(hf), hf_offset=hf_offset,
                  gguf=((GgufPart(gguf),),) if gguf else (), mlx=_names(mlx))


def _names(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    return tuple(value)


def _alternatives(gguf) -> tuple[tuple[GgufPart, ...], ...]:
    """GgufPart, a tuple of parts, or a list of such alternatives -> alternatives of parts."""
    if isinstance(gguf, GgufPart):
        return ((gguf,),)
    if gguf and isinstance(gguf, tuple) and isinstance(gguf[0], GgufPart):
        return (gguf,)
    return tuple(_alternatives(g)[0] for g in gguf)


def mlc_names(table: Iterable[Weight], present: Callable[[str], bool] | None = None) -> dict[str, str]:
    """Canonical tensor -> MLC tensor for every weight: the first of its MLC names whose tensors `present`
    finds (the first name when none is present, so the load reports it missing)."""
    out: dict[str, str] = {}
    for w in table:
        chosen = w.mlc[0]
        if present is not None:
            chosen = next((n for n in w.mlc if all(map(present, w.mlc_tensors(n).values()))), chosen)
        out |= w.mlc_tensors(chosen)
    return out


def mlx_sources(table: Iterable[Weight]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(canonical matrix -> the MLX weights whose rows it joins; canonical vector/param -> its MLX tensor)."""
    matrices, tensors = {}, {}
    for w in table:
        if w.quantized:
            matrices[w.name] = list(w.mlx)
        else:
            tensors[w.name] = w.mlx[0]
    return matrices, tensors
