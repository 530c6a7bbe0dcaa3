"""Token-picking kernels' host side: greedy argmax (one or two passes), and the sampler's repetition penalty and
draw (sample_penalty + sample, sharing the SampleParams uniform of shaders/sample_params.wgsl)."""

from __future__ import annotations

from engine.kernels import declare

ARGMAX = declare("argmax", writes=("tokens", "out_tokens"))
ARGMAX_PARTS = declare("argmax_parts", writes=("parts",))
SAMPLE_PENALTY = declare("sample_penalty", writes=("logits", "window"))
SAMPLE = declare("sample", writes=("tokens", "out_tokens"))
ARGMAX_WG = 256
ARGMAX_SLICE = 2048  # logits per first-pass workgroup: ~8 a thread; 74 workgroups for a 151,936 vocabulary
PENALTY_WG = 64


def argmax_plan(vocab: int) -> tuple[dict, dict | None, int]:
    """(argmax.wgsl constants, argmax_parts.wgsl constants or None, first-pass workgroups): a vocabulary of more
    than two slices is reduced in two passes."""
    parts = -(-vocab // ARGMAX_SLICE)
    if parts <= 2:
        return dict(WG=ARGMAX_WG, VOCAB=vocab, PARTS=0), None, 0
    slice_ = -(-vocab // parts)
    return (dict(WG=ARGMAX_WG, VOCAB=vocab, PARTS=parts),
            dict(WG=ARGMAX_WG, VOCAB=vocab, PARTS=parts, SLICE=slice_), parts)


def sample_plan(vocab: int, window: int, wg: int, cap: int, workgroup_bytes: int) -> tuple[dict, dict]:
    """(sample_penalty.wgsl constants, sample.wgsl constants); sample.wgsl's workgroup memory must fit."""
    shared = 20 * cap + 20 * wg + 12
    if wg & (wg - 1) or shared > workgroup_bytes:
        raise ValueError(f"sampler wg={wg} (a power of two) and cap={cap} need {shared} bytes of workgroup "
                         f"memory; this GPU has {workgroup_bytes}")
    return dict(WG=PENALTY_WG, VOCAB=vocab, WINDOW=window), dict(WG=wg, VOCAB=vocab, CAP=cap)
