"""Mixture-of-experts kernels' host side: router top-k, the expert matvecs (f32 or int8 activations, the expert id
read on the GPU), the prefill's sort of routing pairs by expert and grouped expert GEMM, the weighted combine
of the slots, and the fused decode passes that carry the norms around the block (router on the normed residual,
gate_up with the top-k, down with the combine and the residual add + next norm)."""

from __future__ import annotations

from engine.kernels import MAX_GROUPS_PER_DIM, declare, fold_grid
from engine.kernels.matmul import (
    CHUNK,
    MATVEC_SG_WG,
    WORKGROUP_BYTES,
    _format_consts,
    matvec_plan,
    matvec_q8_plan,
    rows_q8_consts,
    rows_q8_stage_bytes,
)

MOE_ROUTER = declare("moe_router", writes=("ids", "weights"))
MOE_MATVEC = declare("moe_matvec", writes=("y",))
MOE_MATVEC_Q8 = declare("moe_matvec_q8", writes=("y",))
MOE_COMBINE = declare("moe_combine", writes=("out",))
MOE_SORT = declare("moe_sort", writes=("order", "tiles"))
MOE_GEMM = declare("moe_gemm", writes=("y",))
MOE_GEMM_Q8 = declare("moe_gemm_q8", writes=("y", "yq", "ym"))
MOE_ROUTER_NORM = declare("moe_router_norm", writes=("y",))
MOE_GATE_UP_Q8 = declare("moe_gate_up_q8", writes=("act",))
MOE_DOWN_Q8 = declare("moe_down_q8", writes=("out", "nq"))
ROUTER_WG = 64
# Expert matvec shape, measured on the H200 at Qwen3.6 sizes (ROWS 1/2/4/8/16, WG ≤ 32/64): 4 rows and at most
# 32 threads gave the lowest time per layer (BENCH.md).
EXPERT_ROWS = 4
EXPERT_WG = 32  # fewer threads when K has fewer 32-element chunks
COMBINE_WG = 64
SORT_WG = 256
MAX_EXPERTS = 1024  # moe_sort's two per-expert arrays in workgroup memory: 8 KiB at most
# Grouped GEMM tile: a 512-token chunk gives a routed expert ~T·k/E = 16 pairs, so taller tiles would mostly
# compute padding; the shared expert (every token) takes T/16 tiles.
GROUPED_TM = 16
GROUPED_TN = 64  # outputs per tile; halved with gate_up so the staged weight rows stay 64
GROUPED_Q8_KC = 2  # chunks of K per staged step of moe_gemm_q8 (1 where K has an odd number of chunks)


def router_plan(E: int, top_k: int, shared: bool, norm_topk: bool, T: int, wg: int = ROUTER_WG):
    """Constants and grid for shaders/moe_router.wgsl (one workgroup per token)."""
    if not 1 <= top_k <= E or E >= 2**24:
        raise ValueError(f"need 1 ≤ top_k ≤ E < 2^24, got top_k={top_k}, E={E}")
    if wg & (wg - 1):
        raise ValueError(f"WG must be a power of two (workgroup reduction), got {wg}")
    return dict(E=E, TOPK=top_k, SHARED=shared, NORM_TOPK=norm_topk, WG=wg), fold_grid(max(T, 1))


def expert_plan(K: int, N: int, experts: int, T: int, slots: int, *, slot0: int = 0, n_slots: int | None = None,
                gate_up: bool = False, x_slot: bool = False, x_stride: int | None = None,
                y_stride: int | None = None, rows: int | None = None, wg: int | None = None,
                bits: int = 4, zero: int = 0, affine: bool = True, group: int = 64):
    """Constants and grid for shaders/moe_matvec.wgsl over slots [slot0, slot0 + n_slots) of every token."""
    fmt = _format_consts(K, bits, zero, affine, group, three_bit=True)  # moe_matvec reads 3-bit rows as stored
    n_slots = slots - slot0 if n_slots is None else n_slots
    rows = rows or EXPERT_ROWS
    x_stride, y_stride = x_stride or K, y_stride or N
    if wg is None:  # one chunk per thread where K is short (down_proj: K = 512 is 16 chunks)
        wg = max(rows, min(EXPERT_WG, 1 << (K // 32 - 1).bit_length()))
    if wg & (wg - 1) or wg < rows:
        raise ValueError(f"WG must be a power of two ≥ ROWS; got WG={wg}, ROWS={rows}")
    if x_stride % 4 or x_stride < K or y_stride < N or not 0 < slot0 + n_slots <= slots:
        raise ValueError(f"bad strides or slots: X_STRIDE={x_stride}, Y_STRIDE={y_stride}, slots {slot0}+{n_slots}"
                         f" of {slots}")
    groups = -(-N // rows)
    if max(groups, T, n_slots) > MAX_GROUPS_PER_DIM:
        raise ValueError(f"grid ({groups}, {T}, {n_slots}) exceeds {MAX_GROUPS_PER_DIM} per dimension")
    consts = dict(K=K, N=N, EXPERTS=experts, WG=wg, ROWS=rows, GATE_UP=gate_up, SLOTS=slots, SLOT0=slot0,
                  X_SLOT=x_slot, X_STRIDE=x_stride, Y_STRIDE=y_stride, **fmt)
    return consts, (groups, max(T, 1), n_slots)


def expert_q8_plan(K: int, N: int, experts: int, slots: int, subgroup_size: int, *, slot0: int = 0,
                   n_slots: int | None = None, gate_up: bool = False, x_slot: bool = False, y_stride: int | None = None,
                   rows: int | None = None, wg: int = MATVEC_SG_WG, bits: int = 4, zero: int = 0, affine: bool = True,
                   group: int = 64, mixed: tuple[int, int] = (0, 0)):
    """Constants and grid for shaders/moe_matvec_q8.wgsl (decode, one token) over slots [slot0, slot0 + n_slots):
    matvec_q8's constants plus the routing ones; 4-bit stacks or MLX 3-bit ones (read as stored). `mixed`: (u32
    offset in w, f16 offset in s) of a 4-bit last expert stored after a 3-bit stack, or (0, 0)."""
    if mixed[0] and (bits != 3 or mixed[0] % 4 or experts < 2):
        raise ValueError(f"a 4-bit expert after the stack needs a 3-bit stack and a u32 offset that is a multiple of "
                         f"4; got BITS={bits}, offset {mixed[0]}, {experts} experts")
    consts, _ = matvec_q8_plan(K, N, subgroup_size, gate_up=gate_up, rows=rows, wg=wg, bits=bits, zero=zero,
                               affine=affine, group=group, three_bit=True)
    n_slots = slots - slot0 if n_slots is None else n_slots
    y_stride = y_stride or N
    if y_stride < N or not 0 < slot0 + n_slots <= slots:
        raise ValueError(f"bad stride or slots: Y_STRIDE={y_stride}, slots {slot0}+{n_slots} of {slots}")
    consts |= dict(EXPERTS=experts, SLOTS=slots, SLOT0=slot0, X_SLOT=x_slot, Y_STRIDE=y_stride, MIXED_W=mixed[0],
                   MIXED_S=mixed[1])
    return consts, (-(-N // (consts["ROWS"] * consts["BLOCKS"])), 1, n_slots)


def combine_plan(D: int, slots: int, T: int, accumulate: bool = False, wg: int = COMBINE_WG):
    """Constants and grid for shaders/moe_combine.wgsl (one thread per 4 outputs)."""
    if D % 4:
        raise ValueError(f"D must be a multiple of 4, got {D}")
    return dict(D=D, SLOTS=slots, ACCUMULATE=accumulate, WG=wg), fold_grid(-(-max(T, 1) * D // 4 // wg))


def sort_plan(experts: int, slots: int, T: int, *, slot0: int = 0, n_slots: int | None = None, tm: int = GROUPED_TM,
              wg: int = SORT_WG):
    """Constants and grid for shaders/moe_sort.wgsl over slots [slot0, slot0 + n_slots) of up to T tokens, and the
    tile list's size in vec4s: (constants, grid, tile vec4s)."""
    n_slots = slots - slot0 if n_slots is None else n_slots
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"moe_sort handles 1..{MAX_EXPERTS} experts per stack, got {experts}")
    if wg & (wg - 1) or not 0 < slot0 + n_slots <= slots or n_slots < 1 or tm < 1:
        raise ValueError(f"bad sort plan: WG={wg} (a power of two), slots {slot0}+{n_slots} of {slots}, TM={tm}")
    return (dict(EXPERTS=experts, SLOTS=slots, SLOT0=slot0, NSLOTS=n_slots, TM=tm, WG=wg), (1, 1, 1),
            1 + max_tiles(experts, max(T, 1) * n_slots, tm))


def max_tiles(experts: int, pairs: int, tm: int = GROUPED_TM) -> int:
    """The most tiles moe_sort can make: Σ_e ceil(c_e / TM) ≤ floor(pairs / TM) + (experts holding a pair)."""
    return pairs // tm + min(experts, pairs)


def grouped_plan(K: int, N: int, experts: int, T: int, slots: int, *, n_slots: int | None = None,
                 gate_up: bool = False, x_slot: bool = False, x_stride: int | None = None,
                 y_stride: int | None = None, tm: int = GROUPED_TM, tn: int | None = None, bits: int = 4,
                 zero: int = 0, affine: bool = True, group: int = 64):
    """Constants and grid for shaders/moe_gemm.wgsl: the pairs of n_slots slots of up to T tokens, sorted by
    moe_sort with the same TM (the grid's y covers its largest tile list)."""
    fmt = _format_consts(K, bits, zero, affine, group, three_bit=True)  # the GEMM reads 3-bit rows as stored
    n_slots = slots if n_slots is None else n_slots
    tn = tn or (GROUPED_TN // 2 if gate_up else GROUPED_TN)
    wn = tn * (2 if gate_up else 1)
    x_stride, y_stride = x_stride or K, y_stride or N
    if tm % 4 or tn % 4 or tm < 4 or tn < 4 or (tm // 4) * (wn // 4) > 256 or 128 * (tm + wn) > WORKGROUP_BYTES:
        raise ValueError(f"TM={tm}, TN={tn}: need multiples of 4, ≤ 256 threads and 128·(TM + staged W rows) ≤ "
                         f"{WORKGROUP_BYTES} bytes")
    if x_stride % 4 or x_stride < K or y_stride < N:
        raise ValueError(f"bad strides: X_STRIDE={x_stride} for K={K}, Y_STRIDE={y_stride} for N={N}")
    tiles = max_tiles(experts, max(T, 1) * n_slots, tm)
    if tiles > MAX_GROUPS_PER_DIM:
        raise ValueError(f"{tiles} tiles exceed {MAX_GROUPS_PER_DIM} workgroups per dimension: use smaller chunks")
    consts = dict(K=K, N=N, EXPERTS=experts, TM=tm, TN=tn, GATE_UP=gate_up, SLOTS=slots, X_SLOT=x_slot,
                  X_STRIDE=x_stride, Y_STRIDE=y_stride, **fmt)
    x, z = fold_grid(-(-N // tn))
    return consts, (x, tiles, z)


def grouped_q8_plan(K: int, N: int, experts: int, T: int, slots: int, *, n_slots: int | None = None,
                    gate_up: bool = False, x_slot: bool = False, y_stride: int | None = None, tm: int = GROUPED_TM,
                    tn: int | None = None, kc: int | None = None, bits: int = 4, zero: int = 0, affine: bool = True,
                    group: int = 64, rows_q8: bool = False, rows_f32: bool | None = None):
    """Constants and grid for shaders/moe_gemm_q8.wgsl (int8 activations, 4-bit or MLX 3-bit stacks): the pairs of
    n_slots slots of up to T tokens, sorted by moe_sort with the same TM. `rows_q8` (gate_up): the pairs' rows go out
    in int8 (yq, ym; row = pair, N/32 chunks) for the down pass; `rows_f32` (default: not rows_q8) as f32 into y."""
    if bits not in (3, 4):
        raise ValueError(f"moe_gemm_q8 reads 4-bit codes or 3-bit rows, got BITS={bits}")
    fmt = _format_consts(K, bits, zero, affine, group, three_bit=True)
    n_slots = slots if n_slots is None else n_slots
    out, tn = rows_q8_consts(N, gate_up, tn, rows_q8, rows_f32)
    tn = tn or (GROUPED_TN // 2 if gate_up else GROUPED_TN)
    wn = tn * (2 if gate_up else 1)
    chunks = K // 32
    kc = kc or next(c for c in (GROUPED_Q8_KC, 2, 1) if chunks % c == 0)
    lds = kc * (tm + wn) * (48 if affine else 40) + 4 * tm + rows_q8_stage_bytes(tm, rows_q8)
    if tm % 4 or tn % 4 or tm < 4 or tn < 4 or (tm // 4) * (wn // 4) > 256 or lds > WORKGROUP_BYTES:
        raise ValueError(f"TM={tm}, TN={tn}, KC={kc}: need multiples of 4, ≤ 256 threads and ≤ {WORKGROUP_BYTES} "
                         f"bytes of workgroup memory (got {lds})")
    if kc < 1 or chunks % kc:
        raise ValueError(f"KC={kc} must divide the {chunks} chunks of K={K}")
    y_stride = y_stride or N
    if y_stride < N:
        raise ValueError(f"Y_STRIDE={y_stride} is narrower than N={N}")
    tiles = max_tiles(experts, max(T, 1) * n_slots, tm)
    if tiles > MAX_GROUPS_PER_DIM:
        raise ValueError(f"{tiles} tiles exceed {MAX_GROUPS_PER_DIM} workgroups per dimension: use smaller chunks")
    consts = dict(K=K, N=N, EXPERTS=experts, TM=tm, TN=tn, KC=kc, GATE_UP=gate_up, SLOTS=slots, X_SLOT=x_slot,
                  Y_STRIDE=y_stride, **fmt, **out)
    x, z = fold_grid(-(-N // tn))
    return consts, (x, tiles, z)


# The fused decode passes (shaders/moe_gate_up_q8.wgsl, moe_down_q8.wgsl), untuned: gate_up gives each subgroup 2
# outputs (4 weight rows) of its workgroup's 32, up to 512 threads; down gives each thread one weight row of one slot.
FUSED_GATE_UP_ROWS = 2
FUSED_MAX_WG = 512


def decode_pack_layout(F: int, slots: int) -> dict:
    """Where moe_gate_up_q8 leaves a decode token's int8 activations and route for moe_down_q8, in u32 of one buffer:
    codes [slots, F/4] at 0, (scale, Σ codes) pairs [slots, F/32] at AMETA, ids at AIDS, weights (f32 bits) at AWTS;
    `words` in all."""
    meta = slots * F // 4
    ids = meta + slots * F // CHUNK * 2
    return dict(AMETA=meta, AIDS=ids, AWTS=ids + slots, words=ids + 2 * slots)


def _mixed_consts(bits: int, experts: int, mixed: tuple[int, int]) -> dict:
    if mixed[0] and (bits != 3 or mixed[0] % 4 or experts < 2):
        raise ValueError(f"a 4-bit expert after the stack needs a 3-bit stack and a u32 offset that is a multiple of "
                         f"4; got BITS={bits}, offset {mixed[0]}, {experts} experts")
    return dict(MIXED_W=mixed[0], MIXED_S=mixed[1])


def router_norm_plan(D: int, n_logits: int, eps: float, norm_offset: float, *, bits: int, zero: int, affine: bool,
                     group: int):
    """Constants and grid for shaders/moe_router_norm.wgsl: the router matvec (matvec_int4's plan) on the residual
    normed on the fly."""
    consts, grid = matvec_plan(D, n_logits, bits=bits, zero=zero, affine=affine, group=group)
    del consts["LAST_ROW"]
    return dict(consts, EPS=float(eps), NORM_OFFSET=float(norm_offset)), grid


def _threads(want: int, subgroup_size: int, max_threads: int) -> int:
    """Threads for a workgroup that would like `want`: whole subgroups, at most FUSED_MAX_WG and the GPU's limit."""
    cap = min(FUSED_MAX_WG, max_threads) // subgroup_size * subgroup_size
    return max(min(-(-want // subgroup_size) * subgroup_size, cap), subgroup_size)


def gate_up_q8_plan(D: int, F: int, experts: int, E: int, top_k: int, shared: bool, norm_topk: bool,
                    subgroup_size: int, eps: float, norm_pack: dict, act_pack: dict, *, bits: int, zero: int,
                    affine: bool, group: int, mixed: tuple[int, int] = (0, 0), max_threads: int = 256,
                    stream: bool = False):
    """Constants and grid for shaders/moe_gate_up_q8.wgsl (one 32-output chunk of F of one slot per workgroup), or
    None where the shape cannot take it (F not whole chunks, too little workgroup memory). `stream`: the experts are
    the cache slots in slot_ids."""
    if F % CHUNK or D % CHUNK or not 1 <= top_k <= E or E >= 2**24:
        return None
    consts, _ = matvec_q8_plan(D, F, subgroup_size, gate_up=True, rows=FUSED_GATE_UP_ROWS, wg=subgroup_size,
                               bits=bits, zero=zero, affine=affine, group=group, three_bit=True)
    blocks = CHUNK // consts["ROWS"]
    wg = _threads(blocks * subgroup_size, subgroup_size, max_threads)
    lds = D + D // 4 + 4 * (E + shared) + 4 * CHUNK + 16 * wg  # int8 row, its pairs, logits, outputs, reductions
    if lds > WORKGROUP_BYTES:
        return None
    consts |= dict(WG=wg, BLOCKS=blocks, EXPERTS=experts, **_mixed_consts(bits, experts, mixed), E=E, TOPK=top_k,
                   SHARED=bool(shared), NORM_TOPK=bool(norm_topk), STREAM=bool(stream), EPS=float(eps),
                   META=norm_pack["META"],
                   SS=norm_pack["SS"], AMETA=act_pack["AMETA"], AIDS=act_pack["AIDS"], AWTS=act_pack["AWTS"])
    return consts, (F // CHUNK, 1, top_k + shared)


def down_q8_plan(F: int, D: int, experts: int, slots: int, norm: bool, norm_offset: float, norm_pack: dict,
                 act_pack: dict, subgroup_size: int, *, bits: int, zero: int, affine: bool, group: int,
                 mixed: tuple[int, int] = (0, 0), max_threads: int = 256):
    """Constants and grid for shaders/moe_down_q8.wgsl (one 32-output chunk of D for every slot per workgroup, a
    thread per weight row), or None where the shape cannot take it."""
    if bits not in (3, 4):
        raise ValueError(f"moe_down_q8 reads 4-bit codes or 3-bit rows, got BITS={bits}")
    fmt = _format_consts(F, bits, zero, affine, group, three_bit=True)
    if D % CHUNK:
        return None
    wg = _threads(slots * CHUNK, subgroup_size, max_threads)
    lds = slots * F + slots * F // 4 + 4 * slots * CHUNK + 8 * CHUNK + 16 * wg  # rows, pairs, outputs, epilogue
    if wg < CHUNK or lds > WORKGROUP_BYTES:
        return None
    consts = dict(K=F, N=D, EXPERTS=experts, SLOTS=slots, WG=wg, ROWS=1, GATE_UP=False, **fmt,
                  **_mixed_consts(bits, experts, mixed), NORM=bool(norm), NORM_OFFSET=float(norm_offset),
                  META=norm_pack["META"], SS=norm_pack["SS"], AMETA=act_pack["AMETA"], AIDS=act_pack["AIDS"],
                  AWTS=act_pack["AWTS"])
    return consts, fold_grid(D // CHUNK)
