"""The activations every block reads and writes, allocated once per model for one prefill chunk of rows.

Data flow of a forward of T rows: the token ids (`tokens`) → the vocab block embeds them into the residual stream
`res[0]` → the residual block's first norm writes `hidden` (and, with int8 arithmetic, the int8 copy of its last
row in `x_q8`) → per layer a mixer reads `hidden` and writes `delta`, the residual block adds it and norms again,
the feed-forward block does the same → the LM head reads `hidden` into the logits and the sampler writes the next
id into `tokens[0]` and the `ring` the host reads back. `step` is the per-forward uniform.
"""

from __future__ import annotations

from engine.blocks import BufferNeed, destroy_buffers
from engine.kernels import step_struct
from engine.kernels.matmul import norm_pack_layout

RING = 4096  # slots in the GPU ring of sampled token ids


class Workspace:
    """Shared activation buffers; `shared` holds the scratch buffers several blocks use (each at its largest size)."""

    def __init__(self, dim: int, chunk: int, int8_k: int, int8_prefill: bool, shared: dict[str, int],
                 offset_alignment: int = 256, norm_pack: bool = False, norm_splits: int = 1):
        self.dim, self.chunk, self.int8_k, self.int8_prefill = dim, chunk, int8_k, int8_prefill
        # the norms' int8 row without 1/rms when the decode matvecs carry the norms (matvec_q8_norm), with room for
        # the split-K variant's tickets and partials of up to norm_splits workgroups a chunk
        self.norm_pack = norm_pack_layout(dim, offset_alignment, norm_splits) if norm_pack else None
        self.shared_sizes = dict(shared)
        self.step_layout = step_struct()

    def needs(self) -> list[BufferNeed]:
        C, f32, k = self.chunk, 4, self.int8_k
        out = [BufferNeed.buffer("step", self.step_layout.size, usage="uniform"),
               BufferNeed.buffer("tokens", C * 4), BufferNeed.buffer("sampled-ring", RING * 4),
               BufferNeed.buffer("residual-a", C * self.dim * f32), BufferNeed.buffer("residual-b", C * self.dim * f32),
               BufferNeed.buffer("normed-hidden", C * self.dim * f32),
               BufferNeed.buffer("block-out", C * self.dim * f32),
               BufferNeed.buffer("x-int8", k), BufferNeed.buffer("x-int8-scales", k // 32 * 8)]
        if self.norm_pack:
            out.append(BufferNeed.buffer("norm-int8", self.norm_pack["bytes"]))
        if self.int8_prefill:
            out += [BufferNeed.buffer("x-int8-rows", C * k), BufferNeed.buffer("x-int8-rows-scales", C * k // 32 * 8)]
        out += [BufferNeed.buffer(name, size) for name, size in self.shared_sizes.items()]
        out += [BufferNeed.buffer(f"readback-{i}", RING * 4, usage="readback") for i in range(2)]
        return out

    def build(self, gpu) -> None:
        self.gpu = gpu
        made = {need.label: need.allocate(gpu) for need in self.needs()}
        self.step, self.tokens, self.ring = made["step"], made["tokens"], made["sampled-ring"]
        self.res = [made["residual-a"], made["residual-b"]]
        self.hidden, self.delta = made["normed-hidden"], made["block-out"]
        self.x_q8, self.x_q8_meta = made["x-int8"], made["x-int8-scales"]
        self.norm_q8 = made.get("norm-int8")
        self.rows_q8, self.rows_q8_meta = made.get("x-int8-rows"), made.get("x-int8-rows-scales")
        self.shared = {name: made[name] for name in self.shared_sizes}
        self.readback = [made["readback-0"], made["readback-1"]]

    def release(self) -> None:
        destroy_buffers(vars(self))

    def write_step(self, n_tokens: int, pos0: int, out_index: int, attn_splits: int) -> None:
        """The per-forward uniform, its fields set by name (shaders/step.wgsl)."""
        self.gpu.write(self.step, self.step_layout.pack(n_tokens=n_tokens, pos0=pos0, out_index=out_index,
                                                        attn_splits=attn_splits))
