"""GGUF K-quant (Q2_K … Q6_K) and Q5_0 / Q5_1 tensors: raw block bytes → the arrays the K-quant kernels read.

The kernels (shaders/kq_decode.wgsl) read ggml's blocks as stored. A block whose size is a multiple of 4 bytes is
kept whole; the three that are not (Q3_K 110, Q6_K 210, Q5_0 22 bytes) lose their one f16 `d` to a separate array,
so the rest of each block is whole u32 words in its original byte order (a WGSL storage array cannot read a u32 at
a 2-byte offset). The split moves bytes, adds none: q_blocks + q_d hold exactly the tensor's bytes.

| tag | ggml block (bytes, elements) | arrays for an [N, K] tensor, B = K / elements |
|---|---|---|
| q2_k | scales[16], qs[64], d, dmin (84, 256) | q_blocks u32 [N, 21·B] |
| q3_k | hmask[32], qs[64], scales[12] · d (110, 256) | q_blocks u32 [N, 27·B], q_d f16 [N, B] |
| q4_k | d, dmin, scales[12], qs[128] (144, 256) | q_blocks u32 [N, 36·B] |
| q5_k | d, dmin, scales[12], qh[32], qs[128] (176, 256) | q_blocks u32 [N, 44·B] |
| q6_k | ql[128], qh[64], scales[16] · d (210, 256) | q_blocks u32 [N, 52·B], q_d f16 [N, B] |
| q5_0 | d · qh[4], qs[16] (22, 32) | q_blocks u32 [N, 5·B], q_d f16 [N, B] |
| q5_1 | d, m, qh[4], qs[16] (24, 32) | q_blocks u32 [N, 6·B] |

Rows stay independent (a row is B whole blocks), so the reader can fuse and reorder rows of these arrays as it does
for Q4_0. engine/kquant_plan.py binds them (for whole-block types the f16 view is q_blocks itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType


@dataclass(frozen=True)
class KType:
    qtype: GGMLQuantizationType
    elements: int  # per block
    nbytes: int  # per block, as stored
    d_at: int | None  # byte offset of the f16 d split off into q_d (None: the block stays whole)
    halves: bool  # one scale per 16 elements (else per 32)
    code_bytes: tuple[int, int]  # the byte range of the block holding the weight codes (everything else: scales)

    @property
    def words(self) -> int:
        """u32 words per block in q_blocks."""
        return (self.nbytes - (2 if self.d_at is not None else 0)) // 4

    @property
    def halfs(self) -> int:
        """f16 per block in the array bound as the kernels' f16 view (q_d, or q_blocks itself)."""
        return 1 if self.d_at is not None else self.nbytes // 2


TYPES: dict[str, KType] = {
    "q2_k": KType(Q.Q2_K, 256, 84, None, True, (16, 80)),
    "q3_k": KType(Q.Q3_K, 256, 110, 108, True, (0, 96)),
    "q4_k": KType(Q.Q4_K, 256, 144, None, False, (16, 144)),
    "q5_k": KType(Q.Q5_K, 256, 176, None, False, (16, 176)),
    "q6_k": KType(Q.Q6_K, 256, 210, 208, True, (0, 192)),
    "q5_0": KType(Q.Q5_0, 32, 22, 0, False, (2, 22)),
    "q5_1": KType(Q.Q5_1, 32, 24, None, False, (4, 24)),
}
TAGS = {t.qtype: tag for tag, t in TYPES.items()}
for _tag, _t in TYPES.items():  # the table must agree with gguf's own sizes
    assert GGML_QUANT_SIZES[_t.qtype] == (_t.elements, _t.nbytes), _tag
# f16 fields (byte offsets in the block) that must be finite: d, and dmin / m where the type has one.
_HALF_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q5_0": (0,),
                "q5_1": (0, 2)}


def is_ktag(tag: str) -> bool:
    return tag in TYPES


def ktype(tag: str) -> KType:
    if tag not in TYPES:
        raise ValueError(f"{tag!r} is not a K-quant tag; have {', '.join(TYPES)}")
    return TYPES[tag]


def packed_shapes(tag: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Array name -> (shape, dtype) of an [n, k] tensor of type `tag`, as the kernels bind it."""
    t = ktype(tag)
    if n <= 0 or k <= 0 or k % t.elements:
        raise ValueError(f"a {tag} tensor needs rows of a positive multiple of {t.elements} elements, got [{n}, {k}]")
    blocks = k // t.elements
    shapes = {"q_blocks": ((n, blocks * t.words), "uint32")}
    if t.d_at is not None:
        shapes["q_d"] = ((n, blocks), "float16")
    return shapes


def empty(tag: str, n: int, k: int) -> dict[str, np.ndarray]:
    """Uninitialised arrays for an [n, k] tensor (the reader fills them row range by row range)."""
    return {name: np.empty(shape, dtype) for name, (shape, dtype) in packed_shapes(tag, n, k).items()}


def pack_rows(tag: str, raw: np.ndarray, k: int, what: str = "tensor") -> dict[str, np.ndarray]:
    """Rows of a GGUF tensor as bytes [rows, K/elements·nbytes] (GGUFReader's view of a quantized tensor) -> arrays.

    Refuses a wrong byte count and non-finite d / dmin (a NaN scale would turn every logit into NaN); `what` names
    the tensor in those messages."""
    t = ktype(tag)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected rows of bytes, got {raw.dtype} array of shape {raw.shape}")
    blocks = k // t.elements
    if k <= 0 or k % t.elements or raw.shape[1] != blocks * t.nbytes:
        raise ValueError(f"{what}: a {tag.upper()} row of {k} elements is {k // t.elements * t.nbytes} bytes in "
                         f"whole {t.elements}-element blocks, the file has {raw.shape[1]}; the file is damaged")
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).view("<u2").reshape(rows, blocks, t.nbytes // 2)  # every block size is even
    for off in _HALF_FIELDS[tag]:
        inf_nan = (b[:, :, off // 2] & 0x7C00) == 0x7C00  # an all-ones f16 exponent
        if inf_nan.any():
            row = int(np.argwhere(inf_nan)[0][0])
            raise ValueError(f"{what}: row {row} has a non-finite block scale (f16 at byte {off} of a {tag.upper()} "
                             "block); the file is damaged")
    if t.d_at is None:
        return {"q_blocks": b.reshape(rows, -1).view("<u4")}
    d = t.d_at // 2
    flat = b.reshape(rows * blocks, -1)  # one block a row: 2-D slices copy an order of magnitude faster here
    body = np.concatenate([flat[:, :d], flat[:, d + 1:]], axis=1)  # the block less d, its bytes in their order
    return {"q_blocks": body.reshape(rows, -1).view("<u4"), "q_d": np.ascontiguousarray(b[:, :, d]).view("<f2")}


def raw_bytes(tag: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """pack_rows undone: the ggml bytes [rows, B·nbytes] of the arrays (for dequantize and checks)."""
    t = ktype(tag)
    q = np.ascontiguousarray(arrays["q_blocks"])
    rows = q.shape[0]
    body = q.view(np.uint8).reshape(rows, -1, t.words * 4)
    if t.d_at is None:
        return body.reshape(rows, -1)
    d = np.ascontiguousarray(arrays["q_d"]).view(np.uint8).reshape(rows, -1, 2)
    return np.concatenate([body[:, :, :t.d_at], d, body[:, :, t.d_at:]], axis=2).reshape(rows, -1)


def dequantize(tag: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """float32 [rows, K] exactly as ggml dequantizes the stored blocks (gguf.quants.dequantize)."""
    return gguf_dequantize(raw_bytes(tag, arrays), ktype(tag).qtype).astype(np.float32)
