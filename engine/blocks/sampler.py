"""The sampler block: the next token from row 0 of the logits, into tokens[0] (the next embedding's input) and
ring[step.out_index] (what the host reads back), without leaving the GPU. Greedy without a repetition penalty is an
argmax (two passes past ARGMAX_SLICE·2 logits); any other setting is the penalty kernel then the sampling draw."""

from __future__ import annotations

import numpy as np

from engine.blocks import Block, BufferNeed
from engine.gpu import UNIFORM, Gpu
from engine.kernels import uniform_struct
from engine.kernels.sampling import ARGMAX, ARGMAX_PARTS, SAMPLE, SAMPLE_PENALTY, argmax_plan, sample_plan
from engine.sampling import NO_TOKEN, WINDOW, SamplingParams

SAMPLE_WG = 256
SAMPLE_CAP = 512


class GpuArgmax:
    """Greedy decoding's token pick: the largest logit of row 0 into tokens[0] and ring[step.out_index]."""

    def __init__(self, gpu: Gpu, vocab: int, logits, tokens, ring, step):
        final, first, self.parts = argmax_plan(vocab)
        self.steps = []  # (pipeline, bind group, workgroups)
        src = logits
        if first:
            src = gpu.buffer("argmax-parts", 8 * self.parts)
            pipe = gpu.pipeline(ARGMAX_PARTS, first)
            self.steps.append((pipe, gpu.bind(pipe, dict(logits=logits, parts=src), "argmax-parts"), self.parts))
        pipe = gpu.pipeline(ARGMAX, final)
        self.steps.append((pipe, gpu.bind(pipe, dict(logits=src, tokens=tokens, out_tokens=ring, step=step),
                                          "argmax"), 1))

    def record(self, rec) -> None:
        for pipe, bg, groups in self.steps:
            rec.dispatch(pipe, bg, groups)


class GpuSampler:
    """Penalty + sampling kernels, bound once to the runtime's buffers.

    `logits` row 0 is sampled; `tokens[0..n_tokens)` are the ids fed in this forward (appended to the penalty
    window) and tokens[0] receives the sampled id; `ring[step.out_index]` too.
    """

    def __init__(self, gpu: Gpu, vocab: int, logits, tokens, ring, step, wg: int = SAMPLE_WG, cap: int = SAMPLE_CAP):
        penalty, sample = sample_plan(vocab, WINDOW, wg, cap, gpu.limits["max-compute-workgroup-storage-size"])
        self.gpu, self.vocab = gpu, vocab
        self.params = gpu.buffer("sample-params", uniform_struct("sample_params", "SampleParams").size, UNIFORM)
        self.window = gpu.upload("sample-window", np.full(WINDOW, NO_TOKEN, np.uint32))
        self.p_penalty = gpu.pipeline(SAMPLE_PENALTY, penalty)
        self.p_sample = gpu.pipeline(SAMPLE, sample)
        self.bg_penalty = gpu.bind(self.p_penalty, dict(logits=logits, tokens=tokens, window=self.window,
                                                        params=self.params, step=step), "penalty")
        self.bg_sample = gpu.bind(self.p_sample, dict(logits=logits, tokens=tokens, out_tokens=ring, step=step,
                                                      params=self.params), "sample")
        self.set_params(SamplingParams())

    def set_params(self, params: SamplingParams) -> None:
        self.gpu.write(self.params, params.pack(self.vocab))

    def set_history(self, ids) -> None:
        """Rewrite the window from the ids at positions 0..len(ids)-1. The penalty kernel keeps it current on
        every forward that records the sampler; call this after rolling the context back (truncate) or after
        forwards that did not record it."""
        ids = np.asarray(ids, np.uint32)
        window = np.full(WINDOW, NO_TOKEN, np.uint32)
        pos = np.arange(max(0, len(ids) - WINDOW), len(ids))
        window[pos % WINDOW] = ids[pos]
        self.gpu.write(self.window, window)

    def record(self, rec, draws: int = 1) -> None:
        """Append penalty + sampling; `draws` > 1 samples ring[out_index + j] independently (for tests)."""
        if not 1 <= draws <= 65535:
            raise ValueError(f"draws must be in [1, 65535], got {draws}")
        rec.dispatch(self.p_penalty, self.bg_penalty, 1)
        rec.dispatch(self.p_sample, self.bg_sample, draws)


class Sampler(Block):
    """Greedy argmax or the sampler, whichever the sampling parameters call for."""

    name = "sampler"

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.params = SamplingParams()  # greedy until set

    def needs(self) -> list[BufferNeed]:
        parts = argmax_plan(self.vocab)[2]
        out = [BufferNeed.buffer("argmax-parts", 8 * parts)] if parts else []
        return out + [BufferNeed.buffer("sample-params", uniform_struct("sample_params", "SampleParams").size,
                                        usage="uniform"),
                      BufferNeed.upload("sample-window", 4 * WINDOW, "scratch")]

    def build(self, gpu, ws, logits=None) -> None:
        self.argmax = GpuArgmax(gpu, self.vocab, logits, ws.tokens, ws.ring, ws.step)
        self.sampler = GpuSampler(gpu, self.vocab, logits, ws.tokens, ws.ring, ws.step)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0 and self.params.repetition_penalty == 1.0

    def set_params(self, params: SamplingParams) -> None:
        self.params = params
        self.sampler.set_params(params)

    def record(self, rec, layer: int = 0, T: int = 1, splits: int = 1) -> None:
        if self.greedy:
            self.argmax.record(rec)
        else:
            self.sampler.record(rec)
