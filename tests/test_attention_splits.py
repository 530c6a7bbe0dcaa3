"""Which decode attention path a context takes (no GPU): the one-dispatch kernel up to single_pass_keys keys, split-K
in blocks of split_keys past it; and the option's validation."""

import pytest

from engine.bench import shape_spec
from engine.runtime_options import RuntimeOptions
from engine.transformer import RuntimePlan


def splits(**options):
    return RuntimePlan(shape_spec("phi3-mini"), options=RuntimeOptions(max_context=4096, **options)).attention.splits


def test_single_pass_up_to_its_keys_then_split_k():
    s = splits(single_pass_keys=256, split_keys=64)
    assert [s(n) for n in (1, 64, 65, 256)] == [1, 1, 1, 1]
    assert [s(n) for n in (257, 320, 321, 2048, 4096)] == [5, 5, 6, 32, 32]  # at most 32 partitions


def test_split_keys_above_single_pass_keys_keep_one_partition_up_to_them():
    s = splits(single_pass_keys=16, split_keys=100)
    assert [s(16), s(17), s(100), s(101)] == [1, 1, 1, 2]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "64"])
def test_single_pass_keys_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="single_pass_keys must be a positive integer"):
        RuntimeOptions(single_pass_keys=bad)


def test_heads_too_wide_for_the_one_dispatch_kernel_keep_the_separate_kernels():
    from dataclasses import replace

    from engine.kernels.attention import attention_decode_fits

    assert [attention_decode_fits(hd) for hd in (64, 96, 128, 256, 384, 512, 98)] == [True] * 5 + [False] * 2
    spec = shape_spec("phi3-mini")
    wide = replace(spec, n_heads=6, n_kv_heads=6, head_dim=512)  # the same q_dim, heads over 16 KiB of rows
    wide.names = spec.names
    for s, fused in ((spec, True), (wide, False)):
        plan = RuntimePlan(s, options=RuntimeOptions(max_context=256, fused_split_decode=True))
        assert plan.attention.decode_fused == plan.attention.split_fused == fused
        assert any(n.label.endswith("decode-rope") for n in plan.needs()) == fused


def test_fused_split_decode_where_the_adapter_binds_its_storage_buffers():
    """The one-dispatch split-K decode runs where asked and the adapter binds its 10 storage buffers a stage (WebGPU's
    default is 8: such an adapter keeps the three kernels), and plans its own scratch instead of theirs."""
    from dataclasses import replace

    from engine.blocks import DeviceTraits
    from engine.kernels.attention import split_decode_storage_buffers

    assert split_decode_storage_buffers() == 10
    spec = shape_spec("phi3-mini")
    for asked, buffers, fused in ((True, 32, True), (True, 10, True), (True, 9, False), (True, 8, False),
                                  (False, 32, False)):
        traits = replace(DeviceTraits.typical(), storage_buffers=buffers)
        plan = RuntimePlan(spec, options=RuntimeOptions(max_context=256, fused_split_decode=asked), traits=traits)
        assert plan.attention.split_fused == fused
        labels = {n.label for n in plan.needs()}
        assert ("attn-tickets" in labels) == ("attn-split-part" in labels) == fused
        assert ("attn-part-o" in labels) == ("attn-part-ml" in labels) == (not fused)
    with pytest.raises(ValueError, match="fused_split_decode must be true or false"):
        RuntimeOptions(fused_split_decode="yes")


@pytest.mark.parametrize("bad", ["fast", "", None, True])
def test_decode_attention_must_name_a_variant(bad):
    with pytest.raises(ValueError, match="decode_attention must be 'serial', 'batched' or 'lanes'"):
        RuntimeOptions(decode_attention=bad)
