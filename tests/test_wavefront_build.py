"""Building rnnfuse's wavefront kernel on the CPU (no GPU needed).

- the real kernel compiles here (nvcc to an sm_90a cubin, g++ around it) into
  a C-ABI library that links no CUDA runtime or driver (dlopen at first
  call) and carries the cubin;
- its plan answers without a GPU: the headline stack fits a Hopper GPU's
  limits, the refused shapes say why;
- the TensorFlow ops (inference, and the saving forward, one layer's
  backward and the stack's reverse-wavefront backward for training)
  compile around the same sources and register;
- the "auto" backward's choice on the real plan (a Hopper GPU's limits);
- the cache: a second build reuses the files; a missing nvcc names the fix.
The kernel's numbers are tested on the GPU (tests/gpu/test_gpu_wavefront*.py).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rnnfuse.backends.cuda import build, library

H200 = library.H200


@pytest.fixture
def built(built_wavefront, monkeypatch):
    """The real library and its cache (built once a session: conftest),
    the cache being RNNFUSE_CACHE_DIR for the test."""
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(built_wavefront[1]))
    return built_wavefront


@pytest.fixture
def host(wavefront_host):
    """The library's host (plans, argument checks, the C entries) around a
    stand-in cubin, for the tests that never load a kernel: conftest."""
    return library.load(wavefront_host)


def test_the_library_compiles_here_without_a_cuda_runtime(built):
    path, cache = built
    assert path.name == "librnnfuse_wavefront.so" and cache in path.parents
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert "NEEDED" in needed
    assert "libcudart" not in needed and "libcuda.so" not in needed
    # The cubin is inside: its kernels' names are in the library's bytes.
    data = path.read_bytes()
    assert b"rnnfuse_wf_forward_f16" in data and b"rnnfuse_wf_forward_bf16" in data
    assert b"rnnfuse_wf_backward_f16" in data and b"rnnfuse_wf_backward_bf16" in data
    assert b"rnnfuse_wf_backward_stack_f16" in data and b"rnnfuse_wf_backward_stack_bf16" in data


def test_the_headline_stack_fits_an_h200(built):
    lib = library.load(built[0])
    ctas, smem = lib.plan("lstm", 4, 512, 64, 1000, 512, **H200)
    assert ctas <= H200["sms"] and smem <= H200["smem"]
    layers = lib.plan_layers("lstm", 4, 512, 64, 1000, 512, **H200)
    # Layers above the first read 1024 inputs: 4 warps along K, 16 units a CTA.
    assert [l["units"] for l in layers] == [16] * 4
    assert layers[1]["kg"] * layers[1]["mg"] * layers[1]["ng"] == 8
    assert sum(l["ctas"] for l in layers) == ctas == 128


@pytest.mark.parametrize(
    "shape, message",
    [
        (("lstm", 8, 512, 64), "do not fit on chip"),
        (("gru", 2, 1024, 64), "do not fit on chip"),
        (("lstm", 2, 100, 8), "multiple of 8"),
        (("lstm", 9, 64, 8), "1 to 8 layers"),
    ],
)
def test_refused_shapes_say_why(built, shape, message):
    lib = library.load(built[0])
    kind, layers, units, batch = shape
    reason = lib.plan(kind, layers, units, batch, 100, units, **H200)
    assert isinstance(reason, str) and message in reason, reason


def test_a_smaller_device_fits_fewer_layers(built):
    lib = library.load(built[0])
    assert isinstance(lib.plan("lstm", 4, 512, 64, 100, 512, sms=100, smem=H200["smem"]), str)
    assert isinstance(lib.plan("lstm", 4, 512, 64, 100, 512, sms=132, smem=100_000), str)


@pytest.mark.parametrize("shape, training, want", [
    # The shapes: refused whole, run as segments that each fit.
    (("lstm", 8, 512, 32, 1000, 512), False, (4, 4)),
    (("lstm", 8, 512, 32, 1000, 512), True, (4, 4)),
    (("lstm", 2, 1024, 16, 1500, 1024), True, (1, 1)),
    (("gru", 8, 512, 32, 1000, 512), True, (4, 4)),
    # A stack that fits stays whole; one over the layer limit is cut too.
    (("lstm", 4, 512, 64, 1000, 512), True, (4,)),
    (("lstm", 12, 256, 64, 100, 80), False, (6, 6)),
])
def test_stacks_larger_than_the_chip_run_as_segments_that_fit_an_h200(built, shape, training,
                                                                      want):
    from rnnfuse.backends.cuda.segments import stack_segments

    lib = library.load(built[0])
    kind, layers, units, batch, steps, inputs = shape
    if len(want) > 1:
        assert "do not fit on chip" in lib.plan(*shape, **H200) or layers > 8
    assert stack_segments(lib, *shape, training=training, **H200) == want
    # Every segment fits: the stack's input feeds the first, `units` the rest.
    start = 0
    for size in want:
        plan = lib.plan(kind, size, units, batch, steps, inputs if start == 0 else units, **H200)
        assert isinstance(plan, tuple) and plan[0] <= H200["sms"], plan
        start += size


def test_a_stack_whose_one_layer_does_not_fit_has_no_segments(built):
    from rnnfuse.backends.cuda.segments import stack_segments

    lib = library.load(built[0])
    why = stack_segments(lib, "lstm", 3, 1024, 4096, 10, 80, **H200)
    assert isinstance(why, str) and "shared memory does not fit" in why, why


def test_workspace_holds_the_flags_and_the_sequences_below_the_top(built):
    lib = library.load(built[0])
    flags = 4 * 256 * 4  # 4 layers x 256 flags x 4 bytes, already 256-aligned
    assert lib.workspace_bytes(4, 512, 64, 1000) == flags + 3 * 1000 * 64 * 512 * 2
    assert lib.workspace_bytes(1, 8, 1, 1) == 256 * 4  # the flags; no sequence buffer


def test_the_backward_splits_the_headline_layer_over_the_h200(host):
    """16 units a CTA (32 CTAs a 512-unit layer), 4 groups of 16 batch rows."""
    lib = host
    assert lib.backward_plan(512, 64, 1000, **H200) == dict(ctas=128, smem=77120, rows=16)
    assert lib.backward_plan(64, 3, 7, **H200) == dict(ctas=4, smem=19232, rows=8)
    plan = lib.backward_plan(1024, 256, 10, **H200)
    assert plan["ctas"] <= H200["sms"] and plan["smem"] <= H200["smem"]


@pytest.mark.parametrize(
    "shape, message",
    [
        ((100, 8), "multiple of 8 up to 1024"),
        ((2048, 8), "multiple of 8 up to 1024"),
        ((1024, 4096), "shared memory does not fit"),
    ],
)
def test_refused_backward_shapes_say_why(host, shape, message):
    lib = host
    reason = lib.backward_plan(*shape, 100, **H200)
    assert isinstance(reason, str) and message in reason, reason
    small = lib.backward_plan(512, 8, 100, sms=16, smem=H200["smem"])
    assert "needs 32 CTAs for 512 units" in small


def test_the_stack_backward_holds_the_headline_stack_on_an_h200(host):
    """The reverse wavefront: 32 CTAs of 16 units a 512-unit layer, 4 layers
    on 128 SMs, one group of all 64 batch rows; a CTA stages 16 rows x 4H
    gate columns of its own layer's da_{t+1} at a time (two buffers: the
    next chunk lands while this one multiplies), and its 8 warps' partials
    of two m16 tiles (dh, the layer below's dy)."""
    lib = host
    plan = lib.backward_stack_plan(4, 512, 64, 1000, **H200)
    assert plan == dict(
        ctas=128, smem=2 * 16 * (2048 + 8) * 2 + 8 * 16 * 36 * 4 + 64 * 16 * 4 + 64 * 4, rows=64)
    assert plan["smem"] <= H200["smem"]
    # Fewer layers: more groups of fewer rows; the top alone holds 4H columns.
    assert lib.backward_stack_plan(2, 512, 64, 10, **H200)["rows"] == 32
    assert lib.backward_stack_plan(1, 1024, 64, 10, **H200)["ctas"] == 128
    assert lib.backward_stack_plan(1, 8, 1, 1, **H200) == dict(ctas=1, smem=23328, rows=8)
    big = lib.backward_stack_plan(4, 512, 256, 1000, **H200)
    assert big["ctas"] == 128 and big["smem"] <= H200["smem"] and big["rows"] == 256
    assert lib.backward_stack_plan(8, 256, 64, 1000, **H200)["ctas"] == 128
    flags = lib.backward_stack_workspace_bytes(1, 8, 1, 1)
    assert flags >= 4 * (library.STACK_TIMEOUT_WORD + 1) and flags % 256 == 0
    # + the float32 dy hand-off of the 3 layers below the top
    assert lib.backward_stack_workspace_bytes(4, 512, 64, 1000) == flags + 3 * 1000 * 64 * 512 * 4


@pytest.mark.parametrize(
    "shape, message",
    [
        ((8, 512, 64), "do not fit on chip for the reverse-wavefront backward: 8 layers of 512 "
                       "units need 256 CTAs"),
        ((2, 1024, 64), "at most 512 units in a stack of 2 or more layers"),
        ((1, 2048, 64), "multiple of 8 up to 1024"),
        ((2, 100, 8), "multiple of 8 up to 1024"),
        ((9, 64, 8), "1 to 8 layers"),
        ((1, 1024, 4096), "shared memory does not fit"),
        ((2, 64, 0), "batch, steps and inputs >= 1"),
    ],
)
def test_refused_stack_backward_shapes_say_why(host, shape, message):
    lib = host
    layers, units, batch = shape
    reason = lib.backward_stack_plan(layers, units, batch, 100, **H200)
    assert isinstance(reason, str) and message in reason, reason
    small = lib.backward_stack_plan(4, 512, 64, 100, sms=100, smem=H200["smem"])
    assert "need 128 CTAs of one SM each, and the device has 100 SMs" in small
    assert isinstance(lib.backward_stack_plan(4, 512, 64, 100, sms=132, smem=80_000), str)


def _h200_stack_reason(lib):
    """`library.backward_stack_reason` with a Hopper GPU's limits, no GPU."""
    def reason(kind, layers, units, batch, steps, ordinal=0):
        plan = lib.backward_stack_plan(layers, units, batch, steps, **H200)
        return plan if isinstance(plan, str) else None
    return reason


def test_auto_picks_the_stack_backward_where_the_h200_plan_accepts_it(host):
    """The choice rule on the real plan: the headline 4 x 512 B64 T1000 runs
    the reverse wavefront; 7 x 320 (140 CTAs, the forward's 130 fit) runs
    per layer, whose plan accepts it, with the stack plan's refusal as the
    reason; "layer" and "stack" are what was asked."""
    lib = host
    reason = _h200_stack_reason(lib)
    head = library.choose_backward("auto", "lstm", 4, 512, 64, 1000, stack_reason=reason)
    assert head == library.BackwardChoice("stack", "auto", None)
    assert "reverse-wavefront" in head.note
    deep = library.choose_backward("auto", "lstm", 7, 320, 8, 10, stack_reason=reason)
    assert deep.backward == "layer" and deep.requested == "auto"
    assert "do not fit on chip for the reverse-wavefront backward" in deep.reason, deep
    assert deep.reason in deep.note and "per-layer" in deep.note
    assert isinstance(lib.plan("lstm", 7, 320, 8, 10, 64, **H200), tuple)
    assert isinstance(lib.backward_plan(320, 8, 10, **H200), dict)  # v1 runs it
    for asked in ("layer", "stack"):
        assert library.choose_backward(asked, "lstm", 7, 320, 8, 10,
                                       stack_reason=reason).backward == asked


def test_auto_never_raises_and_a_bad_backward_is_a_clear_error():
    def broken(*args):
        raise OSError("libcuda.so.1: cannot open shared object file")

    choice = library.choose_backward("auto", "lstm", 2, 64, 8, 10, stack_reason=broken)
    assert choice.backward == "layer" and "libcuda.so.1" in choice.reason
    unavailable = library.choose_backward("auto", "lstm", 2, 64, 8, 10, unavailable="no GPU",
                                          stack_reason=broken)
    assert unavailable.reason == "no GPU"
    gru = library.choose_backward("auto", "gru", 2, 64, 8, 10)
    assert gru.backward == "layer" and "LSTM stacks only" in gru.reason
    for bad in ("both", "Stack", None, 1):
        with pytest.raises(ValueError, match=f"backward must be one of .*received {bad!r}"):
            library.choose_backward(bad, "lstm", 2, 64, 8, 10, stack_reason=broken)


def test_a_call_without_a_driver_or_a_bad_argument_is_a_clear_error(built):
    lib = library.load(built[0])
    with pytest.raises(library.WavefrontError, match="float16"):
        lib.forward(0, "float32", "lstm", 1, 8, 1, 1, 3, xproj=0, params=0, h0=0, c0=0,
                    lengths=None, y=0, hy=0, cy=0, workspace=0)
    with pytest.raises(library.WavefrontError, match="float16"):
        lib.backward(0, "float32", 8, 1, 1, w_hh=0, gates=0, cseq=0, c0=0, dy=0, dhy=0, dcy=0,
                     lengths=None, dgates=0, dh0=0, dc0=0, workspace=0)
    assert lib.backward_workspace_bytes() >= 4 * (H200["sms"] + 1)
    with pytest.raises(library.WavefrontError, match="float16"):
        lib.backward_stack(0, "float32", 2, 8, 1, 1, 3, params=0, gates=0, cseq=0, c0=0, dy=0,
                           dhy=0, dcy=0, lengths=None, dgates=0, dh0=0, dc0=0, workspace=0)
    try:
        limits = lib.device(0)
    except library.WavefrontError as exc:  # CI: no driver here
        assert "libcuda.so.1" in str(exc) or "cuInit" in str(exc)
    else:  # a GPU machine
        assert limits["sms"] > 0 and limits["smem"] > 0


def test_the_kind_backward_entry_is_declared_as_the_host_defines_it(host):
    """rnnfuse_wf_backward_kind (the LSTM and GRU backward) has as many
    parameters in wavefront_host.cc as library.py declares (ctypes does
    not check), the bindings' declaration (wavefront_abi.h, which the TF op
    includes) has the same list, and a kind the kernel does not run is
    refused before the library is called."""
    import re

    csrc = Path(library.__file__).parent / "csrc"
    host_source = (csrc / "wavefront_host.cc").read_text()
    abi = (csrc / "wavefront_abi.h").read_text()
    op = (Path(library.__file__).parents[1] / "tensorflow" / "csrc" /
          "rnnfuse_wavefront_op.cc").read_text()

    def params(src, name):
        sig = re.search(name + r"\(([^)]*)\)", src).group(1)
        return [" ".join(p.split()[:-1]) for p in sig.split(",")]

    defined = params(host_source, "int rnnfuse_wf_backward_kind")
    assert defined == params(abi, "int rnnfuse_wf_backward_kind")
    assert '#include "wavefront_abi.h"' in op
    declared = host._lib.rnnfuse_wf_backward_kind.argtypes
    assert len(declared) == len(defined) == 18
    for c_type, ctype in zip(defined, declared):
        assert ("*" in c_type) == (ctype is ctypes.c_void_p), (c_type, ctype)
    with pytest.raises(library.WavefrontError, match="not 'simple_rnn'"):
        host.backward(0, "float16", 8, 1, 1, w_hh=0, gates=0, cseq=0, c0=0, dy=0, dhy=0, dcy=0,
                      lengths=None, dgates=0, dh0=0, dc0=0, workspace=0, kind="simple_rnn")


def test_every_kernel_the_host_loads_is_one_the_cubin_source_defines():
    """The names wavefront_host.cc asks the cubin for (cuModuleGetFunction)
    are the kernels wavefront.cu's RF_KERNELS lines define, each in f16 and
    bf16 (and its RF_TMA_KERNEL lines, one a type): the fast loop's check of the variants' kernels, whose compiled
    cubin the slow tests read (test_wavefront_variant.py,
    test_wavefront_wgmma_layout.py)."""
    import re

    csrc = Path(library.__file__).parent / "csrc"
    loaded = set(re.findall(r'cuModuleGetFunction_\([^"]*"(\w+)"',
                            (csrc / "wavefront_host.cc").read_text()))
    source = (csrc / "wavefront.cu").read_text()
    defined = {f"{name}_{t}" for name in re.findall(r"^RF_KERNELS\((\w+),", source, re.M)
               for t in ("f16", "bf16")}
    defined |= set(re.findall(r"^RF_TMA_KERNEL\((\w+),", source, re.M))  # variant 4's, named whole
    assert {f"rnnfuse_wf_forward_v{v}_{t}" for v in (1, 2, 3, 4) for t in ("f16", "bf16")} <= loaded
    assert loaded == defined, (loaded ^ defined)


@pytest.mark.parametrize("name, count", [("rnnfuse_wf_forward_directions", 19),
                                         ("rnnfuse_wf_plan_directions", 10),
                                         ("rnnfuse_wf_plan_offsets", 6)])
def test_the_bidirectional_entries_are_declared_as_the_host_defines_them(built, name, count):
    import re

    host = (Path(library.__file__).parent / "csrc" / "wavefront_host.cc").read_text()
    sig = re.search(r"int " + name + r"\(([^)]*)\)", host).group(1)
    defined = [" ".join(p.split()[:-1]) for p in sig.split(",")]
    declared = getattr(library.load(built[0])._lib, name).argtypes
    assert len(declared) == len(defined) == count
    for c_type, ctype in zip(defined, declared):
        pointer = ctype is ctypes.c_void_p or hasattr(ctype, "contents")
        assert ("*" in c_type) == pointer, (c_type, ctype)
        assert pointer or (c_type, ctype) == ("int", ctypes.c_int), (c_type, ctype)


def test_a_bidirectional_layers_directions_plan_as_independent_first_layers(built):
    """Both directions of a layer in one launch: each planned as a first
    layer (K = H, its own CTA set), so 2 x 1024 units fit where a 2-layer
    stack of 1024 does not; the offsets are the canonical buffer of a
    bidirectional layer (each direction's W_ih of input_size columns)."""
    assert b"rnnfuse_wf_forward_ind_f16" in built[0].read_bytes()
    assert b"rnnfuse_wf_forward_ind_bf16" in built[0].read_bytes()
    lib = library.load(built[0])
    one_layer = lib.plan_layers("lstm", 1, 384, 24, 700, 80, **H200)
    ctas, smem = lib.plan_directions("lstm", 384, 24, 700, 80, **H200)
    assert ctas == 2 * one_layer[0]["ctas"] and smem == one_layer[0]["smem"]
    assert isinstance(lib.plan_directions("lstm", 1024, 16, 100, 2048, **H200), tuple)
    assert "do not fit on chip" in lib.plan("lstm", 2, 1024, 16, 100, 1024, **H200)
    why = lib.plan_directions("lstm", 1024, 4096, 10, 80, **H200)
    assert isinstance(why, str) and "shared memory does not fit" in why
    for kind, gates in (("lstm", 4), ("gru", 3)):
        gh = gates * 384
        offsets = lib.plan_offsets(kind, 2, 384, 80, independent=True)
        assert offsets == [
            dict(w_ih=0, w_hh=gh * 80, b_in=2 * gh * (80 + 384), b_rec=2 * gh * (80 + 384) + gh),
            dict(w_ih=gh * (80 + 384), w_hh=gh * (80 + 384) + gh * 80,
                 b_in=2 * gh * (80 + 384) + 2 * gh, b_rec=2 * gh * (80 + 384) + 3 * gh),
        ]
        # (tests/torch_backend/test_wavefront_bidirectional.py's fake launch
        # reads its weights at this arithmetic, `independent_offsets`.)
        # A stack's layout (not independent) is unchanged: layer 1 reads H inputs.
        stack = lib.plan_offsets(kind, 2, 384, 80)
        assert stack[1]["w_hh"] - stack[1]["w_ih"] == gh * 384


def test_the_tensorflow_op_compiles_and_registers(built, monkeypatch):
    from rnnfuse.backends.tensorflow import op_build

    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(built[1]))
    path = op_build.build_wavefront_op()
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert "libtensorflow_framework" in needed and "libcudart" not in needed
    code = ("import tensorflow as tf, sys; m = tf.load_op_library(sys.argv[1]); "
            "print(all(hasattr(m, n) for n in ('rnnfuse_wavefront', 'rnnfuse_wavefront_saving', "
            "'rnnfuse_wavefront_backward', 'rnnfuse_wavefront_backward_stack')))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert out.stdout.strip().endswith("True"), out.stderr[-2000:]
    assert op_build.build_wavefront_op() == path  # cached


_TRAINING_SHAPES = textwrap.dedent("""\
    import sys, tensorflow as tf
    m = tf.load_op_library(sys.argv[1])
    L, T, B, H, I = 3, 5, 2, 8, 6
    spec = lambda *s, d=tf.float16: tf.TensorSpec(s, d)

    @tf.function(input_signature=[spec(T, B, 4 * H), spec(None), spec(L, B, H), spec(L, B, H),
                                  spec(None, d=tf.int32)])
    def saving(xproj, params, h0, c0, lengths):
        return m.rnnfuse_wavefront_saving(xproj=xproj, params=params, input_h=h0, input_c=c0,
                                          sequence_lengths=lengths, input_size=I)

    @tf.function(input_signature=[spec(4 * H, H), spec(T, B, 4 * H, d=tf.float32),
                                  spec(T, B, H, d=tf.float32), spec(B, H), spec(T, B, H),
                                  spec(B, H), spec(B, H), spec(None, d=tf.int32)])
    def backward(*args):
        return m.rnnfuse_wavefront_backward(*args)

    graph = saving.get_concrete_function().graph.get_operations()
    op = [o for o in graph if o.type == "RnnfuseWavefrontSaving"][0]
    print([o.shape.as_list() for o in op.outputs], [o.dtype.name for o in op.outputs])
    graph = backward.get_concrete_function().graph.get_operations()
    op = [o for o in graph if o.type == "RnnfuseWavefrontBackward"][0]
    print([o.shape.as_list() for o in op.outputs], [o.dtype.name for o in op.outputs])

    @tf.function(input_signature=[spec(None), spec(L, T, B, 4 * H, d=tf.float32),
                                  spec(L, T, B, H, d=tf.float32), spec(L, B, H), spec(T, B, H),
                                  spec(L, B, H), spec(L, B, H), spec(None, d=tf.int32)])
    def stack(*args):
        return m.rnnfuse_wavefront_backward_stack(*args, input_size=I)

    graph = stack.get_concrete_function().graph.get_operations()
    op = [o for o in graph if o.type == "RnnfuseWavefrontBackwardStack"][0]
    print([o.shape.as_list() for o in op.outputs], [o.dtype.name for o in op.outputs],
          op.get_attr("input_size"), op.get_attr("check"))
    """)


def test_the_training_ops_register_with_the_kernels_layouts(built, monkeypatch):
    """RnnfuseWavefrontSaving's outputs: y, hy, cy, hseq [L-1, T, B, H] in the
    element type, gates [L, T, B, 4H] and cseq [L, T, B, H] in float32;
    RnnfuseWavefrontBackward's: dgates [T, B, 4H], dh0 and dc0 [B, H] float32;
    RnnfuseWavefrontBackwardStack's: dgates [L, T, B, 4H], dh0 and dc0
    [L, B, H] float32 (check off unless asked)."""
    from rnnfuse.backends.tensorflow import op_build

    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(built[1]))
    path = op_build.build_wavefront_op()
    out = subprocess.run([sys.executable, "-c", _TRAINING_SHAPES, str(path)],
                         capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()[-3:]
    assert len(lines) == 3, out.stderr[-2000:]
    assert lines[0] == ("[[5, 2, 8], [3, 2, 8], [3, 2, 8], [2, 5, 2, 8], [3, 5, 2, 32], "
                        "[3, 5, 2, 8]] ['float16', 'float16', 'float16', 'float16', 'float32', "
                        "'float32']")
    assert lines[1] == "[[5, 2, 32], [2, 8], [2, 8]] ['float16', 'float32', 'float32']"
    assert lines[2] == ("[[3, 5, 2, 32], [3, 2, 8], [3, 2, 8]] ['float16', 'float32', "
                        "'float32'] 6 False")


_TRAINING_CALLS = textwrap.dedent("""\
    import sys, tensorflow as tf
    from rnnfuse.backends.tensorflow import op_build, wavefront_training as wt
    m = tf.load_op_library(sys.argv[1])
    op_build.load_wavefront_op = lambda: m
    L, T, B, H, I = 2, 5, 2, 8, 6
    f16 = lambda *s: tf.zeros(s, tf.float16)
    f32 = lambda *s: tf.zeros(s, tf.float32)
    params = f16(4 * H * (I + H) + 4 * H * 2 * H + 2 * 4 * H * L)
    calls = [
        lambda: wt.forward_saving(f16(T, B, I), params, f16(L, B, H), f16(L, B, H), None),
        lambda: wt.forward_saving(f16(T, B, I), params, f16(L, B, H), f16(L, B, H),
                                  tf.constant([5, 3])),
        lambda: wt.backward_layer(f16(4 * H, H), f32(T, B, 4 * H), f32(T, B, H), f16(B, H),
                                  f16(T, B, H), f16(B, H), f16(B, H), tf.constant([5, 3])),
        lambda: wt.backward_stack_kernel(params, I, f32(L, T, B, 4 * H), f32(L, T, B, H),
                                         f16(L, B, H), f16(T, B, H), f16(L, B, H), f16(L, B, H),
                                         tf.constant([5, 3]), check=True),
    ]
    for call in calls:
        try:
            call()
        except Exception as exc:
            print(type(exc).__name__, str(exc).splitlines()[0][:200])

    for backward in ("auto", "stack"):
        @tf.function(input_signature=[tf.TensorSpec([T, B, I], tf.float16),
                                      tf.TensorSpec(params.shape, tf.float16)])
        def step(x, params):
            with tf.GradientTape() as tape:
                tape.watch([x, params])
                y, hy, cy = wt.trainable_forward(x, params, f16(L, B, H), f16(L, B, H),
                                                 tf.constant([5, 3]), backward=backward)
                loss = tf.reduce_sum(tf.cast(y, tf.float32))
            return tape.gradient(loss, [x, params])

        graph = step.get_concrete_function().graph
        ops = [o.type for o in graph.get_operations()]
        print("traced", backward, ops.count("RnnfuseWavefrontSaving"),
              ops.count("RnnfuseWavefrontBackward"), ops.count("RnnfuseWavefrontBackwardStack"),
              [g.shape.as_list() for g in step.get_concrete_function().outputs])

    gparams = f16(3 * H * (I + H) + 3 * H * 2 * H + 2 * 3 * H * L)

    @tf.function(input_signature=[tf.TensorSpec([T, B, I], tf.float16),
                                  tf.TensorSpec(gparams.shape, tf.float16)])
    def gru_step(x, params):
        with tf.GradientTape() as tape:
            tape.watch([x, params])
            y, hy, _ = wt.trainable_forward(x, params, f16(L, B, H), None, tf.constant([5, 3]),
                                            kind="gru")
            loss = tf.reduce_sum(tf.cast(y, tf.float32)) + tf.reduce_sum(tf.cast(hy, tf.float32))
        return tape.gradient(loss, [x, params])

    fn = gru_step.get_concrete_function()
    ops = fn.graph.get_operations()
    saving = [o for o in ops if o.type == "RnnfuseWavefrontSaving"]
    bwd = [o for o in ops if o.type == "RnnfuseWavefrontBackward"]
    print("traced gru", len(saving), len(bwd),
          *(o.get_attr("rnn_mode").decode() for o in saving + bwd[:1]),
          [o.shape.as_list() for o in saving[0].outputs][2:],
          [o.shape.as_list() for o in bwd[0].outputs], [g.shape.as_list() for g in fn.outputs])
    """)


def test_the_training_wrappers_bind_to_the_ops_signatures(built, monkeypatch):
    """wavefront_training's calls of the two training ops (keyword names,
    attrs, dtypes) are what the ops take: on the CPU they get as far as
    placement, which finds no CPU kernel (the ops are GPU-only), never a
    TypeError or a shape-function error; and a traced training step (the
    ops' shape functions, tf.custom_gradient in graph mode) builds, with
    one saving forward and one backward op a layer, or (backward="stack")
    one stack backward op."""
    from rnnfuse.backends.tensorflow import op_build

    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(built[1]))
    path = op_build.build_wavefront_op()
    out = subprocess.run([sys.executable, "-c", _TRAINING_CALLS, str(path)],
                         capture_output=True, text=True,
                         env={**__import__("os").environ,
                              "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    assert len(lines) == 7, (out.stdout, out.stderr[-2000:])
    # Traced with a gradient: one saving forward, then one backward op a
    # layer ("auto" here, on the CPU: no driver), or one stack backward op.
    grads = "[[5, 2, 6], [" + str(4 * 8 * (6 + 8) + 4 * 8 * 16 + 64 * 2) + "]]"
    assert lines[4] == "traced auto 1 2 0 " + grads, lines[4]
    assert lines[5] == "traced stack 1 0 1 " + grads, lines[5]
    # A GRU: the same ops with rnn_mode "gru" (cy and dc0 [0]; dgates 4H, the
    # four virtual gates), one backward op a layer.
    gru = str(3 * 8 * (6 + 8) + 3 * 8 * 16 + 48 * 2)
    assert lines[6] == ("traced gru 1 2 gru gru [[0], [1, 5, 2, 8], [2, 5, 2, 32], [2, 5, 2, 8]] "
                        "[[5, 2, 32], [2, 8], [0]] [[5, 2, 6], [" + gru + "]]"), lines[6]
    for line in lines[:4]:
        assert line.startswith(("NotFoundError", "InvalidArgumentError")), line
        assert "GPU" in line or "kernel" in line.lower() or "device" in line.lower(), line


def _fake_tool(root: Path, name: str, log: Path) -> Path:
    """A compiler that records each run and writes its -o file."""
    script = root / name
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        if "--version" in sys.argv:
            print("Cuda compilation tools, release 99.1, V99.1.0")
            sys.exit(0)
        if "--dryrun" in sys.argv:
            print('#$ INCLUDES="-I/usr/local/cuda-13.0/include"')
            sys.exit(0)
        open({str(log)!r}, "a").write({name!r} + "\\n")
        open(sys.argv[sys.argv.index("-o") + 1], "w").write("built")
        """))
    script.chmod(0o755)
    return script


def test_a_second_build_reuses_the_cache(tmp_path, monkeypatch):
    log = tmp_path / "log"
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NVCC", str(_fake_tool(tmp_path, "nvcc", log)))
    monkeypatch.setenv("CXX", str(_fake_tool(tmp_path, "cxx", log)))
    monkeypatch.setattr(build, "cuda_include", lambda nvcc: tmp_path)
    first = build.build_library()
    assert build.build_library() == first
    assert log.read_text().split() == ["nvcc", "cxx"]
    assert "nvcc99.1" in build.build_cubin().parent.name


def test_a_missing_nvcc_names_the_fix(monkeypatch):
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(build.os, "access", lambda path, mode: False)
    with pytest.raises(build.BuildError, match=r"no nvcc found.*Fix: install the CUDA toolkit"):
        build.find_nvcc()


def test_a_failed_library_build_is_not_retried_in_the_process(tmp_path, monkeypatch):
    """Every short call in the static kernel rule asks whether the kernel
    runs: a failed build answers from memory, not from nvcc again."""
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def failing(force=False):
        calls.append(force)
        raise build.BuildError("nvcc failed: unsupported gpu architecture 'sm_90a'")

    monkeypatch.setattr(build, "build_library", failing)
    monkeypatch.setattr(library, "_BUILT", {})
    for _ in range(3):
        with pytest.raises(build.BuildError, match="sm_90a"):
            library._built_library()
    assert calls == [False]


def test_the_library_build_is_checked_once_per_process_not_per_call(tmp_path, monkeypatch):
    """Checking the cached build runs nvcc twice (about 15 ms); torch's
    wavefront call loaded the library three times a call, which made a 12
    ms kernel time at 58 ms in the tuner."""
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RNNFUSE_WAVEFRONT_LIB", raising=False)
    built = tmp_path / "librnnfuse_wavefront.so"
    built.write_text("a library")
    calls = []
    monkeypatch.setattr(build, "build_library", lambda force=False: calls.append(force) or built)
    monkeypatch.setattr(library, "_BUILT", {})
    assert library._built_library() == built
    assert library._built_library() == built
    assert calls == [False]
    built.unlink()  # gone (the cache was cleared): built again
    library._built_library()
    assert calls == [False, False]
