"""RuntimeOptions: every choice a caller (the app, the CLI, a test, a bench) can make about how a model runs.

Passed explicitly to load_model / Transformer; nothing is read from the environment. The defaults are the variants
that measured fastest on the H200 (BENCH.md); the remaining options trade speed for memory or exactness.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

PREFILL_CHUNK = 512  # rows per prefill chunk: 128-row chunks left most of a big GPU idle (BENCH.md)
SPLIT_KEYS = 64  # decode attention splits its keys into blocks of this size (more workgroups in flight)
# Decode attention over at most this many keys is one dispatch per layer (RoPE + KV append + attention, no split-K):
# at 512–640 keys split-K measured faster on the H200 (BENCH.md); up to one 256-key block, one dispatch.
SINGLE_PASS_KEYS = 256
Q8_PREFILL_MIN_DIM = 2048  # int8 prefill by default from this model dim (Phi-3 3072, Qwen3.6 2048; SmolLM2 576)
MAX_PREFILL_CHUNK = 4096
MAX_NORM_MATVEC_SPLITS = 16  # workgroups a chunk of the split-K matvec_q8_norm at most


@dataclass(frozen=True)
class RuntimeOptions:
    """How a model runs on the GPU.

    max_context: tokens the KV cache holds (None: the model's own window; larger values are capped at it).
    prefill_chunk: prompt rows per forward pass (activation buffers hold this many rows).
    q8_decode: 4-bit matrices take int8 activations, quantized per 32 elements like llama.cpp's q8_1 (faster);
        False keeps f32 activations everywhere, prefill included: the exact-arithmetic setting.
    q8_prefill: the prefill GEMMs take int8 activations too (None: for models of dim ≥ Q8_PREFILL_MIN_DIM, where
        the GEMMs are large enough to gain; int8 rounding costs a small model real accuracy). Needs q8_decode.
    q8_epilogues: with int8 prefill GEMMs, the kernels before one (the tiled attention before o, the gate_up GEMM
        before down) write its int8 rows themselves, the same bytes a quantize_q8 dispatch would (False: those
        dispatches, for A/B).
    q8_natural: where every int8 product of a model reads GGUF K-quant blocks (a Q4_K_M file, say), its int8
        activation rows are written in element order, which those blocks' codes meet as stored; the K-quant kernels
        then skip reordering bytes per row (shaders/q8_codes.wgsl Q8_NATURAL). The same integer sums, so the same
        logits bit for bit. False: matvec_q8's order everywhere, as before (for A/B).
    split_keys: decode attention past single_pass_keys keys splits them into blocks of this size.
    single_pass_keys: decode attention over at most this many keys runs as one dispatch per layer (RoPE, KV append,
        attention, the gate and o's int8 input together), one workgroup per query head.
    fused_split_decode: past single_pass_keys, decode attention is still one dispatch per layer: split-K workgroups
        (a head and key split each) whose last of a head combines (shaders/attention_decode_split.wgsl), where the
        adapter binds its 10 storage buffers a stage; False (or fewer allowed): RoPE + append, split-K attention and
        the combine (+ the gate), three (four) dispatches, as before (for A/B).
    decode_attention: the one-dispatch decode attention kernels' variant: "serial" (each key lane's value loads one
        after another, the split combine's partial loads likewise), "batched" (groups of loads in flight before
        any is used; engine/kernels/attention.py attention_decode_consts) or "lanes" (groups of lanes across the
        head dim take a key each, one merge at the end: shaders/attention_decode_lanes.wgsl; batched's combine).
    state_snapshots: (prompt, decode) copies of a linear-attention model's recurrent state kept for rollback.
    snapshot_every: decode positions between two decode snapshots.
    gpu_weights: bytes of model weights allowed on the GPU (engine/gpu_budget.py; None: auto, the adapter's memory
        less the model's other buffers and a margin where it is known, else no limit). A MoE model over it keeps
        its routed experts in host memory behind a GPU expert cache; a dense model over it is refused.
    gate_up_q8: a decode token's dense MLP gate_up writes down's int8 input itself (shaders/matvec_q8_rms_q8.wgsl,
        where the decode matvecs carry the norms), the same bytes as the quantize_q8 dispatch otherwise between them.
        Off by default: one dispatch fewer a layer, yet decode measured 7–12% slower on the H200 (BENCH.md).
    expert_policy: the expert cache's eviction policy, "lfu" (with aging) or "lru" (engine/blocks/expert_cache.py;
        bench/expert_policy.py: equal under random routing, LFU ahead under skewed routing, 85% vs 78% hits at 8 GiB).
    gdn_conv_runs: runs a prefill chunk's Gated DeltaNet conv splits each channel's tokens into, walked at once by
        threads of one workgroup (None: engine/kernels/gdn.py's gdn_conv_runs for the chunk; 1: one thread per
        channel walks the whole chunk as before, for A/B). At most 256; the same outputs bit for bit whatever it is.
    norm_matvec_splits: workgroups each 32-output chunk of a decode matvec that ends in the residual add + next norm
        (matvec_q8_norm: o, down) takes, each over a part of K, the last of a chunk summing their partials and
        writing the epilogue (shaders/matvec_q8_norm_split.wgsl); at most MAX_NORM_MATVEC_SPLITS and one per
        32-element block of K. 1: one workgroup a chunk (matvec_q8_norm.wgsl, as before); None: chosen per matrix so
        the grid fills a large GPU (engine/kernels/matmul.py norm_matvec_splits).
    """

    max_context: int | None = None
    prefill_chunk: int = PREFILL_CHUNK
    q8_decode: bool = True
    q8_prefill: bool | None = None
    q8_epilogues: bool = True
    q8_natural: bool = True
    split_keys: int = SPLIT_KEYS
    single_pass_keys: int = SINGLE_PASS_KEYS
    fused_split_decode: bool = True
    decode_attention: str = "serial"
    state_snapshots: tuple[int, int] = (2, 3)
    snapshot_every: int = 16
    gpu_weights: int | None = None
    expert_policy: str = "lfu"
    gate_up_q8: bool = False
    gdn_conv_runs: int | None = None
    norm_matvec_splits: int | None = 1

    def __post_init__(self) -> None:
        def positive(name: str, value, hi: int | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (hi and value > hi):
                bound = f" and at most {hi}" if hi else ""
                raise ValueError(f"runtime option {name} must be a positive integer{bound}, got {value!r}")

        if self.max_context is not None:
            positive("max_context", self.max_context)
        positive("prefill_chunk", self.prefill_chunk, MAX_PREFILL_CHUNK)
        positive("split_keys", self.split_keys)
        positive("single_pass_keys", self.single_pass_keys)
        positive("snapshot_every", self.snapshot_every)
        if self.gpu_weights is not None:
            positive("gpu_weights", self.gpu_weights)
        if self.gdn_conv_runs is not None:
            positive("gdn_conv_runs", self.gdn_conv_runs, 256)
        if self.decode_attention not in ("serial", "batched", "lanes"):
            raise ValueError(f"runtime option decode_attention must be 'serial', 'batched' or 'lanes', got "
                             f"{self.decode_attention!r}")
        if self.norm_matvec_splits is not None:
            positive("norm_matvec_splits", self.norm_matvec_splits, MAX_NORM_MATVEC_SPLITS)
        if self.expert_policy not in ("lru", "lfu"):
            raise ValueError(f"runtime option expert_policy must be 'lru' or 'lfu', got {self.expert_policy!r}")
        for name in ("q8_decode", "gate_up_q8", "q8_epilogues", "q8_natural", "fused_split_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"runtime option {name} must be true or false, got {getattr(self, name)!r}")
        if self.q8_prefill not in (None, True, False):
            raise ValueError(f"runtime option q8_prefill must be true, false or None, got {self.q8_prefill!r}")
        snaps = tuple(self.state_snapshots) if isinstance(self.state_snapshots, (tuple, list)) else None
        if snaps is None or len(snaps) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64
                                                   for n in snaps):
            raise ValueError(f"runtime option state_snapshots must be two counts in 0..64 (prompt, decode), got "
                             f"{self.state_snapshots!r}")
        object.__setattr__(self, "state_snapshots", snaps)

    @classmethod
    def of(cls, options: RuntimeOptions | None = None, **changes) -> RuntimeOptions:
        """`options` (default: the defaults) with `changes` applied; an unknown name is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown runtime option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        base = options or cls()
        return cls(**{**{f.name: getattr(base, f.name) for f in fields(cls)}, **changes})

    def int8_prefill(self, dim: int) -> bool:
        """Whether the prefill GEMMs take int8 activations for a model of this dim (before the GPU's say)."""
        wanted = dim >= Q8_PREFILL_MIN_DIM if self.q8_prefill is None else self.q8_prefill
        return bool(wanted and self.q8_decode)
