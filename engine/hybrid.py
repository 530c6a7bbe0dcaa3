"""The Qwen3.5 hybrid runtime: DenseTransformer's buffers, sampler, prefill and decode loop, with Gated DeltaNet
(GDN) layers next to gated full-attention layers.

Only full-attention layers keep a paged KV cache. Each GDN layer carries a conv state (the last K−1 raw
q|k|v inputs) and an f32 recurrent state [v_heads, d_k, d_v]; all GDN layers' states live in one `state`
buffer, so a checkpoint of the whole sequence state is a single GPU buffer copy.

Rollback (truncate) contract: attention layers roll back for free (later KV entries get overwritten), the
recurrent state cannot. Snapshots of `state` are kept by position: one before the last token of each
prefill (a regenerate resumes there exactly) and a rolling few every `snapshot_every` decode positions (a
reply that stops mid-batch resumes within a batch or two). truncate(n) restores the newest snapshot at or
before n (or position 0: the kernels start from a zero state when pos0 == 0) and the next forward (prefill,
logits or decode) first replays cached_ids[snapshot:n] through the prefill path. So after truncate(n) the
cache is logically n tokens long (n_cached == n, stream_generate's prefix reuse sees exactly that), and
cached_ids must hold those n ids by the next forward; stream_generate's settle() assigns them.

Weight formats: MLC q4f16_1 by default, or per matrix (`formats`, MLX's mlx4/mlx8/f16) keyed by the
checkpoint's matrices (c_attn, in_proj_*, ...); c_attn's format carries over to qkv and gate, and the four GDN
input projections, fused into one matrix, must share theirs. A layer listed in spec.moe_layers has a MoeBlock
(engine/moe.py) for its MLP, built as soon as the layer's expert weights have arrived (so the host holds one
layer's stacks at a time); all blocks share one set of scratch buffers.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable

import numpy as np

from engine.errors import UnsupportedModelError, ZeroTVMError
from engine.gpu import UNIFORM, Gpu, Recorder
from engine.matmul import packed_shapes
from engine.models.qwen3_5 import FULL, HybridSpec
from engine.moe import MoeBlock
from engine.packed import PackedWeight
from engine.shaders import build_source
from engine.transformer import PAGE, PREFILL_CHUNK, SPLIT_KEYS, DenseTransformer, checked_tensors, require_all

IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")  # fused at load, rows in this order
Q4 = "q4f16_1"

# ---- kernel plans (constants + grid), shared by the runtime and the kernel tests --------------------------


def gdn_dims(spec: HybridSpec) -> dict:
    """Row layout of the fused in_proj output: [q | k | v (conv channels) | z | a | b]."""
    conv, vd, vh = spec.conv_dim, spec.gdn_v_heads * spec.gdn_v_dim, spec.gdn_v_heads
    return dict(CONV=conv, VD=vd, ROW=conv + vd + 2 * vh, Z_OFF=conv, A_OFF=conv + vd, B_OFF=conv + vd + vh)


def gdn_conv_plan(conv: int, row: int, kc: int, wg: int = 64) -> tuple[dict, tuple[int]]:
    if kc < 2:
        raise ValueError(f"conv kernel width must be at least 2, got {kc}")
    return dict(WG=wg, CONV=conv, ROW=row, KC=kc), (-(-conv // wg),)


def gdn_gates_plan(vh: int, row: int, a_off: int, b_off: int, wg: int = 32) -> tuple[dict, int]:
    return dict(WG=wg, VH=vh, ROW=row, A_OFF=a_off, B_OFF=b_off), -(-vh // wg)


def gdn_recur_plan(kh: int, vh: int, dk: int, dv: int, conv: int, wg: int = 128,
                   rsplit: int = 4) -> tuple[dict, tuple[int, int]]:
    """RSPLIT threads per state column (DK / RSPLIT rows each), WG / RSPLIT columns per workgroup: (VH, DV / 32)
    workgroups of 128 threads for Qwen3.5-4B. One thread per whole column (rsplit=1) spilled its 128 registers:
    61 µs per decode dispatch on the H200 (bench/profile_token.py)."""
    if vh % kh or wg & (wg - 1) or dk > 1024 or rsplit < 1 or dk % rsplit or wg % rsplit:
        raise ValueError(f"gdn_recur needs VH % KH == 0, WG a power of two, DK ≤ 1024 and RSPLIT dividing DK and WG; "
                         f"got KH={kh} VH={vh} DK={dk} WG={wg} RSPLIT={rsplit}")
    return dict(WG=wg, RSPLIT=rsplit, KH=kh, VH=vh, DK=dk, DV=dv, CONV=conv), (vh, -(-dv // (wg // rsplit)))


def gdn_norm_plan(vh: int, dv: int, eps: float, row: int, z_off: int) -> dict:
    return dict(WG=min(256, max(32, 1 << (dv - 1).bit_length())), VH=vh, DV=dv, EPS=float(eps), ROW=row, Z_OFF=z_off)


def attn_gate_plan(n: int, wg: int = 256) -> tuple[dict, int]:
    return dict(WG=wg, N=n), -(-n // wg)


_override_pipelines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pipeline(gpu: Gpu, shader: str, consts: dict, overrides: dict | None = None):
    """gpu.pipeline(shader, consts), or one built with WGSL `override` values (NORM_OFFSET) when any are given."""
    if not overrides:
        return gpu.pipeline(shader, consts)
    cache = _override_pipelines.setdefault(gpu, {})
    key = (shader, tuple(sorted(consts.items())), tuple(sorted(overrides.items())), gpu.use_subgroups)
    if key not in cache:
        module = gpu.device.create_shader_module(label=f"{shader}.wgsl", code=build_source(shader, consts, gpu))
        cache[key] = gpu.device.create_compute_pipeline(
            label=shader, layout="auto",
            compute={"module": module, "entry_point": "main", "constants": {k: float(v) for k, v in overrides.items()}},
        )
    return cache[key]


# ---- weights ------------------------------------------------------------------------------------------------


def moe_matrices(spec: HybridSpec) -> dict[str, tuple[int, ...]]:
    """A MoE layer's matrices (canonical suffix after `layers.N.moe.`) -> logical shape ([E,] N, K). gate_up
    stacks hold each expert's gate rows then its up rows; the shared gate is the router's extra row."""
    s = spec
    E, D, F, Fs = s.n_experts, s.dim, s.moe_ffn_dim, s.shared_ffn_dim
    out = {"router": (E, D), "gate_up": (E, 2 * F, D), "down": (E, D, F)}
    if Fs:
        out |= {"shared_gate_up": (2 * Fs, D), "shared_down": (D, Fs), "shared_gate": (1, D)}
    return out


def hybrid_tensor_shapes(spec: HybridSpec, formats: dict[str, str] | None = None
                         ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical tensor name -> (shape, dtype), one entry per checkpoint tensor; `formats` maps a checkpoint
    matrix (embed, layers.N.c_attn, layers.N.moe.gate_up, ...) to its format tag, q4f16_1 where absent."""
    s, formats = spec, formats or {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"norm": ((s.dim,), "float16")}

    def matrix(name, n, k, lead=()):
        for key, (shape, dtype) in packed_shapes(formats.get(name, Q4), n, k).items():
            shapes[f"{name}.{key}"] = ((*lead, *shape), dtype)

    matrix("embed", s.vocab, s.dim)
    if not s.tied_embeddings:
        matrix("lm_head", s.vocab, s.dim)
    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    vh, vd = s.gdn_v_heads, s.gdn_v_heads * s.gdn_v_dim
    for i, kind in enumerate(s.layer_types):
        c = f"layers.{i}"
        shapes[f"{c}.attn_norm"] = shapes[f"{c}.mlp_norm"] = ((s.dim,), "float16")
        if i in s.moe_layers:
            for part, (*lead, n, k) in moe_matrices(s).items():
                matrix(f"{c}.moe.{part}", n, k, tuple(lead))
        else:
            matrix(f"{c}.gate_up", 2 * s.ffn_dim, s.dim)
            matrix(f"{c}.down", s.dim, s.ffn_dim)
        if kind == FULL:
            matrix(f"{c}.c_attn", 2 * q_dim + 2 * kv_dim, s.dim)
            matrix(f"{c}.o", s.dim, q_dim)
            shapes[f"{c}.q_norm"] = shapes[f"{c}.k_norm"] = ((s.head_dim,), "float16")
            continue
        for proj, n in zip(IN_PROJ, (s.conv_dim, vd, vh, vh), strict=True):
            matrix(f"{c}.{proj}", n, s.dim)
        matrix(f"{c}.out", s.dim, vd)
        shapes[f"{c}.A_log"] = shapes[f"{c}.dt_bias"] = ((vh,), "float32")
        shapes[f"{c}.conv1d"] = ((s.conv_dim, 1, s.conv_kernel), "float16")
        shapes[f"{c}.gdn_norm"] = ((s.gdn_v_dim,), "float16")
    return shapes


_FUSED = re.compile(r"layers\.(\d+)\.(c_attn|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b)\.(q_weight|q_scale|weight)$")
_MOE = re.compile(r"layers\.(\d+)\.moe\.(\w+)\.(q_weight|q_scale|weight)$")


def runtime_formats(spec: HybridSpec, formats: dict[str, str] | None) -> dict[str, str]:
    """`formats` plus the matrices the runtime splits or fuses at load: qkv and gate take c_attn's format,
    in_proj the one its four parts share."""
    out = dict(formats or {})
    for i, kind in enumerate(spec.layer_types):
        c = f"layers.{i}"
        if kind == FULL:
            out[f"{c}.qkv"] = out[f"{c}.gate"] = out.get(f"{c}.c_attn", Q4)
            continue
        tags = [out.get(f"{c}.{p}", Q4) for p in IN_PROJ]
        if len(set(tags)) > 1:
            raise UnsupportedModelError(f"layer {i}: the GDN input projections run as one matrix and must share a "
                                        f"weight format; found {dict(zip(IN_PROJ, tags, strict=True))}")
        out[f"{c}.in_proj"] = tags[0]
    return out


class HybridTransformer(DenseTransformer):
    def __init__(self, gpu: Gpu, spec: HybridSpec, weights: Iterable[tuple[str, np.ndarray]],
                 max_context: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 split_keys: int = SPLIT_KEYS,
                 formats: dict[str, str] | None = None, snapshots: tuple[int, int] = (2, 3),
                 snapshot_every: int = 16, gdn_rsplit: int = 4, moe_q8: bool = True, **dense_options):
        self.moe: dict[int, MoeBlock] = {}  # layer -> its MoE block (spec.moe_layers)
        self.gdn_rsplit = gdn_rsplit  # threads per GDN state column (gdn_recur_plan)
        self.moe_q8 = moe_q8  # with q8 decode, the 4-bit experts take int8 activations too (MoeBlock.use_int8)
        self.snap_every = snapshot_every
        self._caps = {"prompt": snapshots[0], "decode": snapshots[1]}
        self._snaps: dict[str, list[tuple[int, object]]] = {"prompt": [], "decode": []}  # (position, buffer)
        self._lag: int | None = None  # position the GDN state is at when behind n_cached (replay pending)
        # dense_options: DenseTransformer's tuning knobs (e.g. matvec_rows), passed through; the combine never
        # writes int8 here, as the o-projection reads the gated attention output (attn_gate), not the combine's.
        super().__init__(gpu, spec, weights, max_context, prefill_chunk, split_keys,
                         formats=runtime_formats(spec, formats), **{**dense_options, "combine_q8": False})

    # ---- weights -------------------------------------------------------------------------------
    def _upload_weights(self, weights) -> dict:
        s, g = self.spec, self.gpu
        self.step = g.buffer("step", 16, UNIFORM)  # here, not in _alloc: the MoE blocks bind it when built
        expected = hybrid_tensor_shapes(s, self.formats)
        moe_left = {i: {c for c in expected if c.startswith(f"layers.{i}.moe.")} for i in s.moe_layers}
        out, seen, parts, moe_parts = {}, set(), {}, {}
        for src, c, arr in checked_tensors(weights, expected, s.names):
            seen.add(c)
            m, moe = _FUSED.match(c), _MOE.match(c)
            if moe is not None:  # held until the layer's last MoE tensor arrives, then uploaded as a block
                layer = int(moe[1])
                moe_parts.setdefault(layer, {}).setdefault(moe[2], {})[moe[3]] = arr
                moe_left[layer].discard(c)
                if not moe_left[layer]:
                    self.moe[layer] = self._moe_block(layer, moe_parts.pop(layer))
            elif m is None:
                out[c] = self._upload(src, arr, vocab=c.startswith(("embed.", "lm_head.")))
            elif m[2] == "c_attn":  # per-head [Q | gate] rows ++ K ++ V -> qkv (Q ++ K ++ V) and gate
                qkv, gate = self._split_c_attn(arr)
                out[f"layers.{m[1]}.qkv.{m[3]}"] = self._upload(f"{src}:qkv", qkv)
                out[f"layers.{m[1]}.gate.{m[3]}"] = self._upload(f"{src}:gate", gate)
            else:  # one in_proj matrix (one matvec) for q|k|v, z, a, b: rows are independent in q4f16_1
                group = parts.setdefault((m[1], m[3]), {})
                group[m[2]] = arr
                if len(group) == len(IN_PROJ):
                    out[f"layers.{m[1]}.in_proj.{m[3]}"] = self._upload(f"layers.{m[1]}.in_proj.{m[3]}",
                                                                       np.concatenate([group[p] for p in IN_PROJ]))
                    del parts[(m[1], m[3])]
        require_all(expected, s.names, seen)
        return out

    def _moe_block(self, i: int, parts: dict[str, dict[str, np.ndarray]]) -> MoeBlock:
        """A layer's MoeBlock from its canonical matrices, keyed and split the way MoeBlock takes them."""
        s, c = self.spec, f"layers.{i}.moe"
        F, Fs = s.moe_ffn_dim, s.shared_ffn_dim

        def packed(part, rows=slice(None)):
            *lead, n, k = moe_matrices(s)[part]
            arrays = {key: a[(slice(None),) * len(lead) + (rows,)] for key, a in parts[part].items()}
            n = len(range(n)[rows])
            return PackedWeight(arrays, self._fmt(f"{c}.{part}"), (*lead, n, k), ())

        weights = {"gate": packed("router"), "switch_mlp.gate_proj": packed("gate_up", slice(0, F)),
                   "switch_mlp.up_proj": packed("gate_up", slice(F, 2 * F)), "switch_mlp.down_proj": packed("down")}
        if Fs:
            weights |= {"shared_expert.gate_proj": packed("shared_gate_up", slice(0, Fs)),
                        "shared_expert.up_proj": packed("shared_gate_up", slice(Fs, 2 * Fs)),
                        "shared_expert.down_proj": packed("shared_down"), "shared_expert_gate": packed("shared_gate")}
        first = next(iter(self.moe.values()), None)
        return MoeBlock(self.gpu, weights, self.step, top_k=s.top_k, norm_topk_prob=s.norm_topk_prob,
                        max_tokens=self.chunk, label=c, share_scratch=first)

    def _split_c_attn(self, arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.spec
        q_rows = 2 * s.n_heads * s.head_dim
        rest = arr.shape[1:]  # [K/8] words, or [groups, 2] affine (scale, bias) pairs
        pairs = arr[:q_rows].reshape(s.n_heads, 2, s.head_dim, *rest)
        qkv = np.concatenate([pairs[:, 0].reshape(s.n_heads * s.head_dim, *rest), arr[q_rows:]])
        return np.ascontiguousarray(qkv), np.ascontiguousarray(pairs[:, 1].reshape(s.n_heads * s.head_dim, *rest))

    # ---- buffers ----------------------------------------------------------------------------------
    def _alloc(self) -> None:
        g, s, C, f32 = self.gpu, self.spec, self.chunk, 4
        d = self.gdn = gdn_dims(s)
        self._alloc_shared(s.attn_layers)
        self.gate = g.buffer("attn-gate", C * self.q_dim * f32)
        self.gated = g.buffer("mixer-out", C * max(self.q_dim, d["VD"]) * f32)  # o_proj / out_proj input
        self.proj = g.buffer("gdn-in-proj", C * d["ROW"] * f32)
        self.conv_out = g.buffer("gdn-conv-out", C * d["CONV"] * f32)
        self.gates = g.buffer("gdn-gates", C * 2 * s.gdn_v_heads * f32)
        self.recur = g.buffer("gdn-recur-out", C * d["VD"] * f32)
        # Per GDN layer: recurrent state then conv state, each at a bindable (aligned) offset.
        align = g.limits.get("min-storage-buffer-offset-alignment", 256)
        recur_bytes = s.gdn_v_heads * s.gdn_k_dim * s.gdn_v_dim * f32
        conv_bytes = (s.conv_kernel - 1) * d["CONV"] * f32
        self.state_slices, off = {}, 0
        for i, kind in enumerate(s.layer_types):
            if kind != FULL:
                conv_off = -(-(off + recur_bytes) // align) * align
                self.state_slices[i] = ((off, recur_bytes), (conv_off, conv_bytes))
                off = -(-(conv_off + conv_bytes) // align) * align
        self.state_bytes = max(off, 16)
        self.state = g.buffer("gdn-state", self.state_bytes)
        self._free = [g.buffer(f"gdn-snapshot-{i}", self.state_bytes) for i in range(sum(self._caps.values()))]

    # ---- pipelines and bind groups (built once) -----------------------------------------------------
    def _build(self) -> None:
        g, s, d = self.gpu, self.spec, self.gdn
        p, self.bg = {}, {}
        self.p = p
        self._gemm_grids: dict[tuple, tuple] = {}
        self._mv_grids: dict[str, tuple] = {}
        offset = {"NORM_OFFSET": s.norm_offset} if s.norm_offset else None
        norm = dict(WG=256, D=s.dim, EPS=float(s.eps), Q8=self.q8_in_norm)
        p["norm0"] = pipeline(g, "rms_norm", norm, offset)
        p["add_norm"] = pipeline(g, "add_rms_norm", norm, offset)
        self._attention_pipelines()
        p["rope_append"] = pipeline(g, "rope_append", dict(
            WG=64, H=s.n_heads, KVH=s.n_kv_heads, HD=s.head_dim, ROT=s.rot_dim, PAGE=PAGE, QK_NORM=True,
            EPS=float(s.eps)), offset)
        gate_consts, self.attn_gate_groups = attn_gate_plan(self.q_dim)
        p["attn_gate"] = g.pipeline("attn_gate", gate_consts)
        conv_consts, self.conv_grid = gdn_conv_plan(d["CONV"], d["ROW"], s.conv_kernel)
        p["gdn_conv"] = g.pipeline("gdn_conv", conv_consts)
        gates_consts, self.gates_groups = gdn_gates_plan(s.gdn_v_heads, d["ROW"], d["A_OFF"], d["B_OFF"])
        p["gdn_gates"] = g.pipeline("gdn_gates", gates_consts)
        recur_consts, self.recur_grid = gdn_recur_plan(s.gdn_k_heads, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim,
                                                       d["CONV"], rsplit=self.gdn_rsplit)
        p["gdn_recur"] = g.pipeline("gdn_recur", recur_consts)
        p["gdn_norm"] = g.pipeline("gdn_norm_out", gdn_norm_plan(s.gdn_v_heads, s.gdn_v_dim, s.eps, d["ROW"],
                                                                 d["Z_OFF"]))

        # role -> (K, N, gate_up); N counts outputs (gate_up's weight has 2N rows)
        self.mats = {"qkv": (s.dim, self.qkv_dim, False),
                     "gate": (s.dim, self.q_dim, False), "o": (self.q_dim, s.dim, False),
                     "in_proj": (s.dim, d["ROW"], False), "out": (d["VD"], s.dim, False)}
        if len(self.moe) < s.n_layers:  # some dense MLP (an all-MoE config may have no intermediate_size)
            self.mats |= {"gate_up": (s.dim, s.ffn_dim, True), "down": (s.ffn_dim, s.dim, False)}

        self._alloc_q8(max([s.dim] + [k for k, _, _ in self.mats.values()]))
        if self.q8 and self.moe_q8 and self.moe:
            act = max(b.int8_act_bytes() for b in self.moe.values())
            act_q8, act_q8_meta = g.buffer("moe-act-int8", act), g.buffer("moe-act-int8-scales", act // 32 * 8)
            for b in self.moe.values():
                b.use_int8(self.x_q8, self.x_q8_meta, self.q8_in_norm, g.subgroup_size, act_q8, act_q8_meta)
        self._build_vocab_ends()
        self._bind_shared()
        self.layer_bg = [self._bind_layer(i) for i in range(s.n_layers)]

    def _bind_layer(self, i: int) -> dict:
        g, s, w, p, st = self.gpu, self.spec, self.w, self.p, self.step
        c, b = f"layers.{i}", {}
        ios = {} if i in self.moe else {"gate_up": (self.hidden, self.ffn), "down": (self.ffn, self.delta)}
        if s.layer_types[i] == FULL:
            kc, vc = self.k_cache[i], self.v_cache[i]
            ios.update(qkv=(self.hidden, self.qkv), gate=(self.hidden, self.gate), o=(self.gated, self.delta))
            b["rope_append"] = g.bind(p["rope_append"], [self.qkv, self.q, kc, vc, self.page_table, self.inv_freq,
                                                         st, w[f"{c}.q_norm"], w[f"{c}.k_norm"]], f"{c}.rope_append")
            b["attn"] = g.bind(p["attn"], [self.q, kc, vc, self.page_table, self.attn, self.part_ml, st], f"{c}.attn")
            b["attn_split"] = g.bind(p["attn_split"], [self.q, kc, vc, self.page_table, self.part_o, self.part_ml,
                                                       st], f"{c}.attn_split")
            b["attn_gate"] = g.bind(p["attn_gate"], [self.attn, self.gate, self.gated, st], f"{c}.attn_gate")
        else:
            (r_off, r_size), (c_off, c_size) = self.state_slices[i]
            ios.update(in_proj=(self.hidden, self.proj), out=(self.gated, self.delta))
            b["gdn_conv"] = g.bind(p["gdn_conv"], [self.proj, w[f"{c}.conv1d"], (self.state, c_off, c_size),
                                                   self.conv_out, st], f"{c}.gdn_conv")
            b["gdn_gates"] = g.bind(p["gdn_gates"], [self.proj, w[f"{c}.A_log"], w[f"{c}.dt_bias"], self.gates, st],
                                    f"{c}.gdn_gates")
            b["gdn_recur"] = g.bind(p["gdn_recur"], [self.conv_out, self.gates, (self.state, r_off, r_size),
                                                     self.recur, st], f"{c}.gdn_recur")
            b["gdn_norm"] = g.bind(p["gdn_norm"], [self.recur, self.proj, w[f"{c}.gdn_norm"], self.gated, st],
                                   f"{c}.gdn_norm")
        for name, (src, dst) in ios.items():
            tag = self._fmt(f"{c}.{name}")
            # gate reads the normed rows that qkv's int8 GEMM, recorded just before it, has quantized already
            ready = name == "gate" and len(b["mm"]["qkv"]) == 2
            self._bind_mv(b, name, tag, src, self._matrix(f"{c}.{name}"), dst, f"{c}.mv_{name}")
            self._bind_mm(b, name, tag, src, self._matrix(f"{c}.{name}"), dst, f"{c}.mm_{name}", rows_ready=ready)
        next_norm = w[f"layers.{i + 1}.attn_norm"] if i + 1 < s.n_layers else w["norm"]
        b["add_norm1"] = g.bind(p["add_norm"], [self.res[0], self.delta, w[f"{c}.mlp_norm"], self.res[1],
                                                self.hidden, st, *self.q8_out], f"{c}.add_norm1")
        b["add_norm2"] = g.bind(p["add_norm"], [self.res[1], self.delta, next_norm, self.res[0], self.hidden, st,
                                                *self.q8_out], f"{c}.add_norm2")
        return b

    # ---- recording ------------------------------------------------------------------------------------
    def _record_body(self, rec: Recorder, T: int, splits: int) -> None:
        """Embedding through the final norm for T rows; T == 1 takes the decode kernels."""
        if T == 1 and self.n_cached % self.snap_every == 0:
            self._snapshot("decode", rec)  # before this token touches the state
        self._record_layers(rec, T, splits)

    def _record_token_body(self, rec, splits: int) -> None:
        self._record_layers(rec, 1, splits)  # the snapshot is position-dependent: _record_decode_token takes it

    def _record_decode_token(self, rec: Recorder, splits: int) -> None:
        if self.n_cached % self.snap_every == 0:
            self._snapshot("decode", rec)
        super()._record_decode_token(rec, splits)

    def _record_layers(self, rec: Recorder, T: int, splits: int) -> None:
        s, p, v = self.spec, self.p, self.spec.gdn_v_heads
        self._record_embed(rec, T)
        rec.dispatch(p["norm0"], self.bg["norm0"], T)
        for i, (kind, b) in enumerate(zip(s.layer_types, self.layer_bg, strict=True)):
            if kind == FULL:
                self._mm(rec, b, "qkv", T)
                self._mm(rec, b, "gate", T)
                rec.dispatch(p["rope_append"], b["rope_append"], T, s.n_heads + 2 * s.n_kv_heads)
                self._record_attention(rec, b, T, splits)
                rec.dispatch(p["attn_gate"], b["attn_gate"], self.attn_gate_groups, T)
                self._mm(rec, b, "o", T)
            else:
                self._mm(rec, b, "in_proj", T)
                rec.dispatch(p["gdn_conv"], b["gdn_conv"], *self.conv_grid)
                rec.dispatch(p["gdn_gates"], b["gdn_gates"], self.gates_groups, T)
                rec.dispatch(p["gdn_recur"], b["gdn_recur"], *self.recur_grid)
                rec.dispatch(p["gdn_norm"], b["gdn_norm"], v, T)
                self._mm(rec, b, "out", T)
            rec.dispatch(p["add_norm"], b["add_norm1"], T)
            if i in self.moe:
                self.moe[i].record(rec, self.hidden, self.delta, T)
            else:
                self._mm(rec, b, "gate_up", T)
                self._mm(rec, b, "down", T)
            rec.dispatch(p["add_norm"], b["add_norm2"], T)

    def _count_decode_dispatches(self) -> int:
        """Dispatches in one greedy decode step without split attention (the sampler adds one): per layer 6 for
        its mixer, 2 residual add+norms, then 2 for a dense MLP or the MoE block's (5 with the shared expert
        stacked, 7 without)."""
        mlp = sum(b.dispatch_count(decode=True) for b in self.moe.values()) + 2 * (self.spec.n_layers - len(self.moe))
        q8 = sum(self._quantize_dispatches(b) for b in self.layer_bg)  # for q8 matvecs that no norm feeds
        return 2 + 8 * self.spec.n_layers + mlp + 1 + len(self.argmax.steps) + q8 + bool(self.lm_quantize)

    # ---- state snapshots --------------------------------------------------------------------------------
    def _snapshots(self) -> list[tuple[int, object]]:
        return self._snaps["prompt"] + self._snaps["decode"]

    def _snapshot(self, kind: str, rec: Recorder | None = None) -> None:
        """Copy `state` (the state before position n_cached) into a snapshot slot of `kind`."""
        pos = self.n_cached
        if pos == 0 or self._caps[kind] == 0 or any(q == pos for q, _ in self._snapshots()):
            return
        ring = self._snaps[kind]
        buf = ring.pop(0)[1] if len(ring) >= self._caps[kind] else self._free.pop()
        ring.append((pos, buf))
        if rec is not None:
            rec.copy(self.state, 0, buf, 0, self.state_bytes)
        else:
            self._copy(self.state, buf)

    def _copy(self, src, dst) -> None:
        enc = self.gpu.device.create_command_encoder(label="gdn-state-copy")
        enc.copy_buffer_to_buffer(src, 0, dst, 0, self.state_bytes)
        self.gpu.queue.submit([enc.finish()])

    def _drop_snapshots(self, after: int) -> None:
        for ring in self._snaps.values():
            self._free += [buf for q, buf in ring if q > after]
            ring[:] = [(q, buf) for q, buf in ring if q <= after]

    def _catch_up(self) -> None:
        """Replay the tokens between the restored state and n_cached (see the module docstring)."""
        if self._lag is None:
            return
        start, end = self._lag, self.n_cached
        if len(self.cached_ids) < end:
            raise ZeroTVMError(f"cannot rebuild the recurrent state up to position {end}: token ids after "
                               f"{len(self.cached_ids)} are unknown (set cached_ids after truncate, as "
                               "engine/generate.py does)")
        ids = np.asarray(self.cached_ids[start:end], np.uint32)
        self._lag, self.n_cached = None, start
        for i in range(0, len(ids), self.chunk):
            super()._forward(ids[i:i + self.chunk], "none")

    # ---- public API (DenseTransformer's, with the state kept in step) -----------------------------------
    def reset(self) -> None:
        super().reset()
        self._lag = None
        self._drop_snapshots(after=0)

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens: restore the newest snapshot at or before n; the next forward
        replays the rest from cached_ids."""
        n = min(self.n_cached, max(0, n))
        at = self.n_cached if self._lag is None else self._lag  # where the GDN state really is
        self._drop_snapshots(after=n)
        if n < at:
            at, buf = max(self._snapshots(), key=lambda e: e[0], default=(0, None))
            if buf is not None:
                self._copy(buf, self.state)
        self._lag = at if at < n else None
        self.n_cached = n
        self.cached_ids = self.cached_ids[:n]

    def _forward(self, ids: np.ndarray, then: str, out_index: int = 0) -> np.ndarray | None:
        self._catch_up()
        return super()._forward(ids, then, out_index)

    def prefill(self, ids, out_index: int = 0) -> None:
        """DenseTransformer.prefill, with a state snapshot taken before the last token (where a regenerate
        of the same prompt resumes)."""
        ids = np.asarray(ids, np.uint32)
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self._check_room(len(ids))
        self._catch_up()
        head = ids[:-1]
        for start in range(0, len(head), self.chunk):
            self._forward(head[start:start + self.chunk], "none")
        self._snapshot("prompt")
        super().prefill(ids[-1:], out_index)

    def decode(self, last_index: int, count: int, batch: int = 8):
        self._catch_up()  # eagerly: DenseTransformer.decode is a generator
        return super().decode(last_index, count, batch)
