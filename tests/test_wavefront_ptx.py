"""The forward kernels' synchronisation as nvcc compiles it (PTX, no GPU).

A forward kernel that publishes its steps on the flags (fence.acq_rel.gpu,
then the flag's store: wavefront.cuh, "One step of one CTA") must also wait
on them (the flag polls, ld.acquire.gpu) before it stages a step's h: without
the wait a CTA copies h rows its neighbours and the layer below have not
written yet, whatever the buffer held (the NaN of bench_wavefront.py
check's poisoned outputs, the previous call's values in the workspace), and
it runs faster than any correct kernel. Variant 3 publishes nothing and
waits in the data instead (tests/test_wavefront_lamport.py).

Variant 2 also needs wgmma's own ordering: the proxy fence after its
copies, the wgmma fence before the products and the wait before their
accumulators are read (tests/test_wavefront_wgmma_layout.py has its layout
arithmetic). Variant 4 stages through the async proxy instead: mbarrier
waits, and no proxy fence, between its copies and its products
(tests/test_wavefront_tma_layout.py has its copies and descriptors). What this cannot check: that the hardware honours them;
`tools/gpu/batch.sh wavefront-wgmma-diag` and `wavefront-wgmma` do.
"""

from __future__ import annotations

import re

import pytest

from rnnfuse.backends.cuda import build

TYPES = ("f16", "bf16")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    """{kernel name: its PTX body} of csrc/wavefront.cu, compiled with the
    build's flags (-ptx in place of -cubin)."""
    nvcc = build.find_nvcc()
    out = tmp_path_factory.mktemp("ptx") / "wavefront.ptx"
    flags = ["-ptx" if f == "-cubin" else f for f in build.NVCC_FLAGS]
    build.run_compiler([nvcc, *flags, str(build.SOURCE_DIR / "wavefront.cu"), "-o", str(out)],
                       "rnnfuse's wavefront kernel to PTX", "check that nvcc is CUDA 12.4 or newer")
    return entries(out.read_text())


def entries(text: str) -> dict[str, str]:
    """Each `.entry NAME(` of a PTX module and the text up to the next one.

    >>> entries(".entry a(\\n x\\n}\\n.entry b(\\n y\\n}")
    {'a': '.entry a(\\n x\\n}\\n', 'b': '.entry b(\\n y\\n}'}
    """
    found = list(re.finditer(r"\.entry (\w+)\(", text))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return {m.group(1): text[m.start():end] for m, end in zip(found, ends)}


def forward(variant: int, t: str) -> str:
    return f"rnnfuse_wf_forward_{t}" if variant == 0 else f"rnnfuse_wf_forward_v{variant}_{t}"


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("variant", [0, 1, 2, 4])
def test_a_forward_that_publishes_its_steps_waits_for_its_inputs(ptx, variant, t):
    body = ptx[forward(variant, t)]
    assert "fence.acq_rel.gpu" in body  # the publication
    assert "ld.acquire.gpu" in body, f"{forward(variant, t)} publishes its steps but never polls"


@pytest.mark.parametrize("t", TYPES)
def test_variant_three_waits_in_the_data_not_on_flags(ptx, t):
    body = ptx[forward(3, t)]
    assert "ld.acquire.gpu" not in body and "fence.acq_rel.gpu" not in body
    assert "st.relaxed.gpu" in body  # its h stores are the publication


@pytest.mark.parametrize("t", TYPES)
def test_variant_two_orders_its_copies_and_its_products(ptx, t):
    body = ptx[forward(2, t)]
    suffix = "f16.f16" if t == "f16" else "bf16.bf16"
    # 16 k-steps (K 512) and 32 (K 1024), each an unrolled run of its own
    assert body.count(f"wgmma.mma_async.sync.aligned.m64n32k16.f32.{suffix}") == 48
    assert body.count("wgmma.fence.sync.aligned") == 2
    assert body.count("wgmma.commit_group.sync.aligned") == 2
    assert body.count("wgmma.wait_group.sync.aligned 0") == 2
    assert "fence.proxy.async.shared::cta" in body
    # the other kernels (but variant 4, variant 2's products) are plain sm_90 code
    assert all("wgmma" not in b for name, b in ptx.items()
               if "forward_v2" not in name and "forward_v4" not in name)


def wait_shape(body: str) -> tuple[int, str]:
    """(flag polls, what follows the last poll up to its CTA barrier) of a
    forward kernel: barriers between the polls show in the first."""
    polls = [m.start() for m in re.finditer(r"ld\.acquire\.gpu", body)]
    between = body[polls[0]:polls[-1]]
    assert not re.search(r"\bbar(rier)?\.(sync|arrive)", between), "a barrier inside the poll loops"
    after = body[polls[-1]:]
    barrier = re.search(r"\bbar(rier)?\.sync\s+0;", after)
    return len(polls), after[:barrier.start()]


@pytest.mark.parametrize("t", TYPES)
def test_variant_two_waits_as_variant_zero_does(ptx, t):
    """One warp's poll loops, no barrier inside them, then the CTA barrier
    before any copy of the step's h: variant 2's wait is variant 0's."""
    polls0, tail0 = wait_shape(ptx[forward(0, t)])
    polls2, tail2 = wait_shape(ptx[forward(2, t)])
    assert polls2 == polls0 == 2
    assert "cp.async" not in tail0 and "cp.async" not in tail2


@pytest.mark.parametrize("t", TYPES)
def test_variant_four_waits_on_its_copies_not_on_a_proxy_fence(ptx, t):
    """Variant 4 stages hs by tensor copies that complete on an mbarrier:
    its only shared-memory proxy fence is the prologue's (the zeroed hs and
    the barriers' initialisation), before the first copy; between the copies
    and the products sit only the barrier waits. Each copying lane fences
    its acquired view of global memory to the async proxy before copying."""
    body = ptx[forward(4, t)]
    copy = body.index("cp.async.bulk.tensor.3d.shared::cluster.global.tile"
                      ".mbarrier::complete_tx::bytes")
    first_product = body.index("wgmma.mma_async")
    assert body.count("fence.proxy.async.shared::cta") == 1
    assert body.index("fence.proxy.async.shared::cta") < body.index("ld.acquire.gpu") < copy
    assert body.index("mbarrier.init") < body.index("fence.mbarrier_init") < copy
    assert body.index("ld.acquire.gpu") < body.index("fence.proxy.async.global") < copy
    assert body.index("mbarrier.arrive.expect_tx") < copy
    between = body[copy:first_product]
    assert "mbarrier.try_wait.parity" in between
    assert not re.search(r"fence\.proxy|membar|fence\.(sc|acq_rel)|cp\.async\.wait", between)
    suffix = "f16.f16" if t == "f16" else "bf16.bf16"
    assert body.count(f"wgmma.mma_async.sync.aligned.m64n32k16.f32.{suffix}") == 48


@pytest.mark.parametrize("t", TYPES)
def test_variant_four_waits_for_its_flags_as_variant_zero_does(ptx, t):
    polls0, tail0 = wait_shape(ptx[forward(0, t)])
    polls4, tail4 = wait_shape(ptx[forward(4, t)])
    assert polls4 == polls0 == 2
    assert "cp.async" not in tail4
