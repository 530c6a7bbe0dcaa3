"""The attention side's kernels: RoPE + KV-cache append, paged attention (whole or split-K), the split-K combine,
Qwen3.5's output gate, and the one-dispatch decode attention that does all of them for one token (whole, or split-K
with the last workgroup of each head combining)."""

from __future__ import annotations

import math

from engine.kernels import declare, row_outputs

ROPE_APPEND = declare("rope_append", writes=("q_out", "k_cache", "v_cache"))
ATTENTION = declare("attention", writes=("out", "part_ml"))
ATTENTION_TILED = declare("attention_tiled", writes=("out", "xq", "xm"))
COMBINE = declare("attention_combine", writes=("out", "xq", "xm"))
ATTN_GATE = declare("attn_gate", writes=("y", "xq", "xm"))
ATTENTION_DECODE = declare("attention_decode", writes=("k_cache", "v_cache", "out", "xq", "xm"))
ATTENTION_DECODE_SPLIT = declare("attention_decode_split", writes=("k_cache", "v_cache", "out", "xq", "xm", "part",
                                                                   "tickets"))
ROPE_WG = 64
COMBINE_WG = 64
# One workgroup per query head walks every key in blocks of this many (more keys a block, fewer online-softmax
# rescales and barriers; more key lanes in the P·V phase).
DECODE_WG = 256


def attention_consts(n_heads: int, n_kv_heads: int, head_dim: int, page: int, split: bool = False) -> dict:
    """Constants for attention.wgsl (grid (H, T, splits)): WG covers head_dim/4 lanes, a power of two ≤ 256."""
    if head_dim % 4 or head_dim > 1024:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 4 and at most 1024")
    wg = max(64, 1 << math.ceil(math.log2(head_dim // 4)))
    return dict(WG=min(wg, 256), H=n_heads, KVH=n_kv_heads, HD=head_dim, PAGE=page,
                SCALE=1.0 / math.sqrt(head_dim), SPLIT=split)


TILED_ROWS = 32  # query rows a workgroup of attention_tiled.wgsl owns


def attention_tiled_plan(n_heads: int, n_kv_heads: int, head_dim: int, page: int, rows_q8: bool = False,
                         rows_f32: bool | None = None) -> dict | None:
    """Constants for attention_tiled.wgsl (prefill chunks), or None where it does not apply (head_dim not a multiple
    of 32). HG query heads of one kv head share a workgroup: the largest power of two dividing the group, ≤ 32.
    `rows_q8`: the output rows go to int8 (the o-projection's GEMM input); `rows_f32` (default: not rows_q8) as f32."""
    if head_dim % 32 or n_heads % n_kv_heads:
        return None
    group = n_heads // n_kv_heads
    hg = 1
    while group % (2 * hg) == 0 and 2 * hg <= TILED_ROWS:
        hg *= 2
    return dict(H=n_heads, KVH=n_kv_heads, HD=head_dim, HG=hg, PAGE=page, SCALE=1.0 / math.sqrt(head_dim),
                **row_outputs("attention_tiled", rows_q8, rows_f32))


def attention_tiled_grid(consts: dict, T: int) -> tuple[int, int, int]:
    """Grid of attention_tiled.wgsl over T tokens: (H / HG, token blocks, 1)."""
    bt = TILED_ROWS // consts["HG"]
    return consts["H"] // consts["HG"], -(-T // bt), 1


def combine_consts(n_heads: int, head_dim: int, q8: bool) -> dict:
    """Constants for attention_combine.wgsl (grid (H, T)); with Q8 it also writes the int8 row (HD % 32 == 0)."""
    if q8 and head_dim % 32:
        raise ValueError(f"the combine writes int8 rows only for head_dim a multiple of 32, got {head_dim}")
    return dict(WG=COMBINE_WG, H=n_heads, HD=head_dim, Q8=bool(q8))


def rope_append_consts(n_heads: int, n_kv_heads: int, head_dim: int, rot_dim: int, page: int, qk_norm: bool,
                       eps: float, norm_offset: float = 0.0, rope_scale: float = 1.0) -> dict:
    """Constants for rope_append.wgsl (grid (T, H + 2·KVH): one head per workgroup)."""
    if head_dim % 2 or rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"RoPE needs even head_dim and rotary dims ≤ head_dim; got {head_dim}, {rot_dim}")
    return dict(WG=ROPE_WG, H=n_heads, KVH=n_kv_heads, HD=head_dim, ROT=rot_dim, PAGE=page, QK_NORM=bool(qk_norm),
                EPS=float(eps), NORM_OFFSET=float(norm_offset), ROPE_SCALE=float(rope_scale))


def attn_gate_plan(n: int, wg: int = 256, rows_q8: bool = False, rows_f32: bool | None = None) -> tuple[dict, int]:
    """Constants and x-groups for attn_gate.wgsl (grid (groups, T)). `rows_q8`: the gated rows also (or only) go
    to int8, the o-projection's input (n and wg multiples of 32); `rows_f32` (default: not rows_q8) as f32."""
    if rows_q8 and (n % 32 or wg % 32):
        raise ValueError(f"attn_gate writes int8 rows only for whole 32-element chunks a workgroup, got N={n} WG={wg}")
    return dict(WG=wg, N=n, **row_outputs("attn_gate", rows_q8, rows_f32)), -(-n // wg)


def attention_decode_fits(head_dim: int, wg: int = DECODE_WG) -> bool:
    """Whether attention_decode.wgsl takes this head size: a multiple of 4, a thread per vec4 chunk at least, and
    its workgroup memory (q, new k and v, output: a head row each; per thread a weight, a row offset, a partial
    output and the reduction's slot) within WebGPU's default 16 KiB."""
    return head_dim % 4 == 0 and head_dim // 4 <= wg and 4 * head_dim * 4 + wg * (4 + 4 + 16 + 16) <= 16384


DECODE_ATTENTION_VARIANTS = ("serial", "batched", "lanes")
LANES_SUBGROUP = 8  # "lanes": the subgroup size a lane's chunks are sized for where none is known


def attention_decode_consts(rope: dict, gate_offset: int | None, q8: bool, wg: int = DECODE_WG,
                            variant: str = "serial", subgroup: int = LANES_SUBGROUP) -> dict:
    """Constants for attention_decode.wgsl (grid (H, 1, 1)) from rope_append_consts' (`rope`): `gate_offset` the
    f32 index of the gate row in the qkv binding (None: no gate); `q8` also writes the int8 row (HD % 32 == 0).
    `variant` "batched": the P·V value loads (and the split kernel's combine loads) go out in groups before any is
    used; "serial": one at a time, as before (for A/B); "lanes": attention_decode_lanes.wgsl's walk (groups of lanes
    across the head dim, a key at a time each), its lane chunks sized for subgroups of `subgroup` lanes (the
    adapter's); the batched kernels where the subgroups at run time are too small for them."""
    if variant not in DECODE_ATTENTION_VARIANTS:
        raise ValueError(f"decode attention variant must be one of {DECODE_ATTENTION_VARIANTS}, got {variant!r}")
    hd = rope["HD"]
    if not attention_decode_fits(hd, wg):
        raise ValueError(f"attention_decode takes head_dim a multiple of 4 whose rows fit its workgroup memory "
                         f"(at most 384 with {wg} threads), got {hd}")
    if q8 and hd % 32:
        raise ValueError(f"the decode attention writes int8 rows only for head_dim a multiple of 32, got {hd}")
    pv = next(n for n in (4, 3, 2, 1) if hd // 4 % n == 0)  # vec4 chunks a thread accumulates in the P·V phase
    c = hd // 4
    lane_chunks = -(-c // min(max(subgroup, 1), 1 << (c.bit_length() - 1)))  # chunks a lane holds in "lanes"
    return dict(rope, WG=wg, SCALE=1.0 / math.sqrt(hd), GATE=gate_offset is not None, GATE_OFF=gate_offset or 0,
                Q8=bool(q8), PV=pv, BATCHED=variant in ("batched", "lanes"), LANES=variant == "lanes",
                LANE_CHUNKS=lane_chunks)


def split_decode_wg(head_dim: int, variant: str = "serial") -> int:
    """Threads of attention_decode_split.wgsl: attention.wgsl's (a split holds about split_keys keys, so 256 threads
    a workgroup would mostly sit out the scores); "lanes" 128 at least (more lane groups on a split's keys)."""
    wg = attention_consts(1, 1, head_dim, 1)["WG"]
    return max(wg, 128) if variant == "lanes" else wg


def split_decode_storage_buffers() -> int:
    """Storage buffers attention_decode_split.wgsl binds in its one stage (over WebGPU's default of 8: the adapter's
    max-storage-buffers-per-shader-stage decides whether it runs)."""
    return sum(b.space == "storage" for b in ATTENTION_DECODE_SPLIT.bindings.values())


def split_decode_part_bytes(n_heads: int, head_dim: int, max_splits: int) -> int:
    """Bytes of attention_decode_split.wgsl's `part` binding: per head and split a record of o and (m, l), rounded up
    to 128 bytes (R4 vec4s)."""
    r4 = (head_dim // 4 + 8) // 8 * 8
    return n_heads * max_splits * r4 * 16
