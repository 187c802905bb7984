"""rnnfuse's wavefront kernel on the GPU: exactness checks and timings (torch only).

Runs on a Hopper GPU with nothing but python3, torch and numpy: the
kernel's framework-free modules (rnnfuse/backends/cuda/library.py,
rnnfuse/backends/torch/wavefront.py) are imported without running the
rnnfuse package (no Keras needed). The library is $RNNFUSE_WAVEFRONT_LIB or
built into the cache (nvcc + g++).

    python3 bench/bench_wavefront.py check --random 12 --out $OUT/check.json
    python3 bench/bench_wavefront.py bench --cells headline --out $OUT/bench.json
    python3 bench/bench_wavefront.py bench --cells matrix --budget 200 --out $OUT/matrix.json
    python3 bench/bench_wavefront.py modes --out $OUT/modes.json    # a step's parts left out
    python3 bench/bench_wavefront.py trace --out $OUT/trace.json    # the kernel's own timeline
    # the forward step's opt-in variant 1 (wavefront.cuh): checked, then timed against 0
    python3 bench/bench_wavefront.py check --variant 1 --random 12 --out $OUT/check_v1.json
    python3 bench/bench_wavefront.py bench --cells headline --variants 0,1 --out $OUT/bench_v01.json
    python3 bench/bench_wavefront.py trace --variant 1 --out $OUT/trace_v1.json
    python3 bench/bench_wavefront.py grad --random 4 --out $OUT/grad.json   # LSTM gradients
    python3 bench/bench_wavefront.py grad --kinds gru --random 4 --out $OUT/grad_gru.json   # GRU
    python3 bench/bench_wavefront.py train --kinds gru --cells 1 --out $OUT/train_gru.json
    python3 bench/bench_wavefront.py train --out $OUT/train.json    # a training step's time
    # the reverse-wavefront backward (v2, opt-in): one launch for every layer
    python3 bench/bench_wavefront.py grad --random 4 --backward stack --out $OUT/grad_stack.json
    python3 bench/bench_wavefront.py train --cells 2 --backward stack --out $OUT/train_stack.json
    # the forward's opt-in variant 2 (wgmma; wavefront.cuh, "Variant 2"): checked, then timed
    python3 bench/bench_wavefront.py check --variant 2 --random 6 --out $OUT/check_v2.json
    python3 bench/bench_wavefront.py bench --cells headline --variants 0,2 --kernel-only
    # variant 4 (variant 2 staged by tensor copies; "Variant 4"), with the edge shapes
    python3 bench/bench_wavefront.py check --variant 4 --fixed 4 --edge 5 --random 6
    python3 bench/bench_wavefront.py bench --cells headline --variants 0,2,4 --kernel-only
    # the forward's opt-in variant 3 (the h values as their own flags; "Variant 3")
    python3 bench/bench_wavefront.py check --variant 3 --random 6 --out $OUT/check_v3.json
    python3 bench/bench_wavefront.py bench --cells headline --variants 0,3 --kernel-only
    # its opt-in pipelined variants (wavefront.cuh, "Variants"): checked, and timed interleaved
    python3 bench/bench_wavefront.py grad --random 4 --backward stack --variant 1
    python3 bench/bench_wavefront.py train --cells 2 --backward stack --variants 0,1,2
    # stacks larger than the chip as wavefront segments (8x512 B32 T1000, 2x1024 B16 T1500)
    python3 bench/bench_wavefront.py segments --train --out $OUT/segments.json
    # bidirectional layers, one launch a layer (BiLSTM 4x384 B24 T700, BiGRU 5x512 B32 T500)
    python3 bench/bench_wavefront.py bidirectional --train --out $OUT/bidirectional.json
    # randomized exactness over the brief's ranges, within a time budget
    python3 bench/bench_wavefront.py sweep --cases 200 --seed 0 --budget 110 --out $OUT/sweep.json

`check`: each case draws fresh random weights, inputs, initial states (and
lengths), poisons the outputs with NaN, runs the kernel and compares y, hy
(and cy) with a float64 reference of the same (rounded) weights and with
cuDNN (torch.nn.LSTM/GRU in the same dtype), as ||out - ref|| / ||ref||.
A shape outside the kernel's limits must raise WavefrontError (the caller's
fallback to cuDNN), never run. `bench`: CUDA-event medians of the kernel
(with layer 0's input GEMM, and alone), cuDNN as one multi-layer call
(torch's, the standard algorithm) and one call per layer (where torch runs
cuDNN's persistent kernel for float16), in ms, us a dependent step and
TFLOP/s next to the floor at PEAK_TFLOPS (a measured dense rate).
`grad`: an LSTM's (and with `--kinds lstm,gru` or `gru` a GRU's, on
GRU_GRAD_CASES and random GRU shapes) outputs AND gradients (dx, dh0, an
LSTM's dc0, every weight and bias) through `wavefront.trainable_forward`
(the forward saving gates and c, or a GRU's r, z, n, W_hn h + b_hn and
h_{t-1}; the backward kernel, per layer for a GRU) against autograd of the float64 reference of the
same rounded weights and against cuDNN's gradient in the same dtype, for
the same upstream gradients; a shape outside the kernels' limits must
raise WavefrontError. `train`: CUDA-event medians of a training step
(forward + backward, every gradient) on the kernels against cuDNN's
(torch.nn.LSTM, i.e. torch._VF.lstm, forward + backward), and its parts.
`--backward stack` (grad, train): the backward is `backward_stack_wavefront`
(every layer's recurrence in ONE reverse-wavefront launch, then the GEMMs)
instead of `backward_stack` (one launch a layer, the default "layer"):
grad checks it the same way (a timed-out wait in the kernel is an error;
its plan's refusals must raise WavefrontError from the backward pass) and
adds STACK_GRAD_CASES; train times it beside the layer-by-layer backward
and reports how far its gradients are from the layer path's. `--variant N`
(grad, train; with --backward stack): the stack kernel's variant (0, the
default; 1, 2 opt-in; the rows say which one the plan chose, as it falls
back where the asked one does not fit). `--variants 0,1,...` (train): every
variant's recurrence, backward and training step timed interleaved (rounds
of one median each, in turn) in one process, with the ratio to the first
and the largest difference of its dgates from the first's (the variants
add in the same order: 0 expected).
`--variant N` (check, bench, trace, modes): the FORWARD step's variant
(wavefront.cuh; 0 the default). check with N != 0 also runs variant 0 on
the same inputs and, for an LSTM, the saving forward of both (gates_out,
c_out), and requires every output within TOL of variant 0's
(`err_vs_variant0`). `check --edge N`: also the first N of EDGE_CASES,
the shapes variants 2 and 4 take at their edges (batches not a multiple of
32, several chunks, K padded). `bench --variants 0,N` times the variants interleaved
(call by call, one process) and reports each one's ms and N's ratio to the
first (`ratio_kernel_only`, `ratio_kernel`).
`segments`: stacks larger than the chip (SEGMENT_CELLS), refused whole and
run as consecutive kernel launches, one a segment, chosen on this GPU's
plan (`segments.stack_segments`): the error of the segmented forward
against float64 and cuDNN's, then the segmented kernel, cuDNN as one
multi-layer call and cuDNN a layer at a time timed interleaved (ms, us a
dependent step, TFLOP/s, the speed-up over cuDNN's best); with `--train`,
a training step (forward + every gradient) of each, the segments on
`trainable_forward`.
`bidirectional`: bidirectional stacks (BIDIRECTIONAL_CELLS) on the kernel,
one launch a layer (`wavefront_bidirectional.forward`): the error against
float64 of the same rounded weights and cuDNN's, with and without lengths,
and the kernel, cuDNN as one multi-layer call and cuDNN a layer at a time
timed interleaved (ms, us a layer-step, TFLOP/s, the speed-up over cuDNN's
best); with `--train`, a training step of the training form (a one-layer
launch a direction), its directions one after the other and on two CUDA
streams (`concurrent`), against cuDNN's bidirectional call, interleaved.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_kernel_modules():
    """library and the torch binding, without rnnfuse's package __init__s."""
    for name in ("rnnfuse", "rnnfuse.backends", "rnnfuse.backends.cuda", "rnnfuse.backends.torch"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = mod
    from rnnfuse.backends.cuda import library
    from rnnfuse.backends.torch import wavefront

    return library, wavefront


import torch  # noqa: E402

library, wavefront = _import_kernel_modules()

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PEAK_TFLOPS = 790.0  # measured bf16/fp16 dense matrix rate (docs/kernel.md, "The floor")
# Tolerances for ||kernel - ref64|| / ||ref64||: a few ulps of the storage type
# accumulated over the recurrence; the check also reports cuDNN's own error.
TOL = {"float16": 1e-3, "bfloat16": 8e-3}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def make_module(kind: str, layers: int, units: int, inputs: int, dtype, gen):
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    mod = cls(inputs, units, layers).cuda()
    bound = 1.0 / math.sqrt(units)
    with torch.no_grad():
        for w in mod._flat_weights:
            w.copy_((torch.rand(w.shape, generator=gen, device="cuda") * 2 - 1) * bound)
    return mod.to(dtype)


def reference(kind, mod, x, h0, c0, lengths):
    """float64 forward of `mod`'s (already rounded) weights; cuDNN's padding rules."""
    return wavefront.reference_forward(kind, mod._flat_weights, x, h0, c0, lengths)


def cudnn_forward(kind, mod, x, h0, c0, lengths):
    state = (h0, c0) if kind == "lstm" else h0
    with torch.no_grad():
        if lengths is None:
            y, st = mod(x, state)
        else:
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), enforce_sorted=False)
            yp, st = mod(packed, state)
            y, _ = torch.nn.utils.rnn.pad_packed_sequence(yp, total_length=x.shape[0])
    hy, cy = (st if kind == "lstm" else (st, None))
    return y, hy, cy


def kernel_forward(kind, mod, x, h0, c0, lengths, mode=0, poison=True, variant=0, saving=False):
    """The kernel on NaN-poisoned outputs (forward_into); `saving` (LSTM):
    also returns the saved gates and c (float32, NaN-poisoned first)."""
    steps, batch, inputs = x.shape
    layers, units = mod.num_layers, mod.hidden_size
    params = wavefront.flat_params(mod).contiguous()
    gh = (4 if kind == "lstm" else 3) * units
    xproj = (x.reshape(-1, inputs) @ params[: gh * inputs].view(gh, inputs).t()).view(steps, batch, gh)
    y = torch.full((steps, batch, units), float("nan") if poison else 0.0, dtype=x.dtype, device="cuda")
    hy = torch.full_like(h0, float("nan"))
    cy = torch.full_like(h0, float("nan")) if kind == "lstm" else h0.new_empty(0)
    lib = library.load()
    ws = torch.empty(lib.workspace_bytes(layers, units, batch, steps), dtype=torch.uint8, device="cuda")
    lens = lengths.to(torch.int32).contiguous() if lengths is not None else None
    gates = cseq = None
    if saving:
        gates = torch.full((layers, steps, batch, 4 * units), float("nan"), device="cuda")
        cseq = torch.full((layers, steps, batch, units), float("nan"), device="cuda")
    wavefront.forward_into(xproj.contiguous(), params, h0, c0 if kind == "lstm" else h0.new_empty(0),
                           lens, y, hy, cy, ws, kind=kind, input_size=inputs, mode=mode,
                           variant=variant, gates_out=gates, c_out=cseq)
    if saving:
        return y, hy, cy, gates, cseq
    return y, hy, (cy if kind == "lstm" else None)


def valid_steps(t: torch.Tensor, lengths) -> torch.Tensor:
    """[L, T, B, ...] saved values with the steps at t >= len zeroed (the
    backward never reads them)."""
    if lengths is None:
        return t
    steps = t.shape[1]
    keep = torch.arange(steps, device=t.device)[:, None] < lengths.to(t.device)[None, :]
    return torch.where(keep[None, :, :, None], t, torch.zeros_like(t))


def variant_errors(kind, mod, x, h0, c0, lengths, y, hy, cy, variant) -> dict:
    """||variant N - variant 0|| / ||variant 0|| of y, hy (cy) and, for an
    LSTM, of the saving forward's gates and c (valid steps only)."""
    y0, hy0, cy0 = kernel_forward(kind, mod, x, h0, c0, lengths)
    out = dict(y=rel(y, y0), hy=rel(hy, hy0))
    if kind == "lstm":
        out["cy"] = rel(cy, cy0)
        s0 = kernel_forward(kind, mod, x, h0, c0, lengths, saving=True)
        sn = kernel_forward(kind, mod, x, h0, c0, lengths, variant=variant, saving=True)
        out["saving_y"] = rel(sn[0], s0[0])
        out["gates"] = rel(valid_steps(sn[3], lengths), valid_steps(s0[3], lengths))
        out["c"] = rel(valid_steps(sn[4], lengths), valid_steps(s0[4], lengths))
    return out


def refused_row(row: dict, reason: str, run) -> dict:
    """`row` for a shape the plan refuses (`reason`): `run` must raise the
    library's WavefrontError before launching (status "fallback"); a run
    that goes through is a FAIL."""
    try:
        run()
    except library.WavefrontError as exc:
        row.update(status="fallback", reason=str(exc))
    else:
        row.update(status="FAIL", reason=f"ran although unsupported: {reason}")
    return row


def check_case(kind, layers, units, batch, steps, inputs, dtype_name, with_lengths, seed,
               variant=0):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mod = make_module(kind, layers, units, inputs, dtype, gen)
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").to(dtype)
    h0 = (torch.randn(layers, batch, units, generator=gen, device="cuda") * 0.5).to(dtype)
    c0 = (torch.randn(layers, batch, units, generator=gen, device="cuda") * 0.5).to(dtype)
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen, device="cuda")
        lengths[0] = steps  # the padded output keeps T steps
    row = dict(kind=kind, layers=layers, units=units, batch=batch, steps=steps, inputs=inputs,
               dtype=dtype_name, lengths=with_lengths, seed=seed, variant=variant)
    reason = wavefront.unsupported_reason(kind, layers, units, batch, steps, inputs, dtype,
                                          torch.device("cuda"))
    if reason is not None:
        return refused_row(row, reason, lambda: kernel_forward(kind, mod, x, h0, c0, lengths,
                                                               variant=variant))
    t0 = time.perf_counter()
    try:
        y, hy, cy = kernel_forward(kind, mod, x, h0, c0, lengths, variant=variant)
    except library.WavefrontError as exc:
        if variant and f"variant {variant}" in str(exc):  # a plan the variant does not take
            return dict(row, status="fallback", reason=str(exc))
        raise
    torch.cuda.synchronize()
    unwritten = sum(int(torch.isnan(t).sum()) for t in (y, hy, cy) if t is not None)
    ry, rhy, rcy = reference(kind, mod, x, h0, c0, lengths)
    cy_, chy, ccy = cudnn_forward(kind, mod, x, h0, c0, lengths)
    err = dict(y=rel(y, ry), hy=rel(hy, rhy))
    cud = dict(y=rel(cy_, ry), hy=rel(chy, rhy))
    vs = dict(y=rel(y, cy_), hy=rel(hy, chy))
    if kind == "lstm":
        err["cy"], cud["cy"], vs["cy"] = rel(cy, rcy), rel(ccy, rcy), rel(cy, ccy)
    worst = max(err.values())
    ok = unwritten == 0 and math.isfinite(worst) and worst <= max(TOL[dtype_name], 2 * max(cud.values()))
    if variant:
        # Variant N sums the same products in another float32 order: its
        # outputs and saved values stay within TOL of variant 0's.
        row["err_vs_variant0"] = variant_errors(kind, mod, x, h0, c0, lengths, y, hy, cy, variant)
        vworst = max(row["err_vs_variant0"].values())
        ok = ok and math.isfinite(vworst) and vworst <= TOL[dtype_name]
    row.update(status="ok" if ok else "FAIL", unwritten=unwritten, err_vs_f64=err,
               cudnn_err_vs_f64=cud, err_vs_cudnn=vs, seconds=round(time.perf_counter() - t0, 2))
    return row


FIXED_CASES = [
    # kind, layers, units, batch, steps, inputs, dtype, lengths
    ("lstm", 4, 512, 64, 100, 512, "float16", False),
    ("lstm", 4, 512, 64, 100, 512, "float16", True),
    ("gru", 4, 512, 64, 100, 512, "float16", True),
    ("lstm", 4, 512, 64, 60, 512, "bfloat16", False),
    ("gru", 2, 256, 8, 50, 40, "bfloat16", False),
    ("lstm", 1, 1024, 32, 20, 1024, "float16", False),
    ("gru", 8, 256, 100, 30, 256, "bfloat16", True),
    ("lstm", 3, 384, 1, 40, 100, "float16", False),
    ("lstm", 2, 64, 3, 7, 5, "float16", True),
    ("lstm", 4, 512, 256, 20, 512, "float16", True),
    ("gru", 1, 8, 1, 1, 3, "float16", False),
    ("lstm", 8, 512, 64, 10, 512, "float16", False),   # outside the limits: fallback
]


EDGE_CASES = [
    # kind, layers, units, batch, steps, inputs, dtype, lengths
    ("lstm", 4, 512, 33, 30, 512, "float16", True),     # a second half of 1 row
    ("gru", 4, 512, 100, 20, 512, "bfloat16", False),   # two chunks, the second 36 rows
    ("lstm", 3, 512, 200, 10, 512, "float16", True),    # four chunks, the last 8 rows
    ("lstm", 4, 384, 64, 20, 384, "float16", False),    # K 768 padded to 1024
    ("lstm", 4, 320, 20, 10, 320, "bfloat16", True),    # one half; K 320 and 640 padded
]


def random_cases(n: int, seed: int):
    """Random shapes over the brief's ranges; two in three drawn from stacks
    that fit on chip (4 x 512, 8 x 256, 1 x 1024 and below), the rest from
    anything (those must fall back)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        if i % 3 < 2:
            layers, top = rng.choice([(rng.randint(1, 4), 512), (rng.randint(1, 8), 256),
                                      (1, 1024), (rng.randint(1, 3), 640)])
            units = rng.choice([u for u in (64, 128, 200, 256, 320, 384, 512, 640, 1024) if u <= top])
        else:
            layers = rng.randint(1, 8)
            units = rng.choice([64, 128, 200, 256, 320, 384, 512, 640, 768, 1024])
        batch = rng.choice([1, 2, 5, 16, 33, 64, 100, 128, 200, 256])
        steps = int(round(math.exp(rng.uniform(0, math.log(2000)))))
        steps = max(1, min(steps, 6000 // layers))  # keeps the float64 reference short
        cases.append((rng.choice(["lstm", "gru"]), layers, units, batch, steps,
                      rng.choice([units, 32, 300]), rng.choice(["float16", "bfloat16"]),
                      rng.random() < 0.5))
    return cases


def run_cases(name, cases, run_case, seed, shown, out):
    """Runs `run_case(*case, seed=...)` for each case, recording an error as
    a row; prints each row's `shown` keys, keeps the JSON at `out` current,
    and returns 1 if any case neither passed nor fell back, else 0."""
    rows = []
    for i, case in enumerate(cases):
        try:
            row = run_case(*case, seed=seed * 1000 + i)
        except Exception as exc:  # noqa: BLE001 - record and go on
            row = dict(case=list(case), status="ERROR", reason=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        print(list(case), json.dumps({k: row.get(k) for k in shown}), flush=True)
        _dump(out, dict(meta=_meta(), results=rows))
    bad = [r for r in rows if r["status"] not in ("ok", "fallback")]
    print(f"{name}: {len(rows) - len(bad)}/{len(rows)} passed", flush=True)
    return 1 if bad else 0


def cmd_check(args):
    cases = (FIXED_CASES[: args.fixed] + EDGE_CASES[: args.edge]
             + random_cases(args.random, args.seed))
    return run_cases("check", cases, functools.partial(check_case, variant=args.variant),
                     args.seed, ("status", "err_vs_f64", "cudnn_err_vs_f64", "err_vs_variant0",
                                 "reason"), args.out)


def time_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_interleaved(fns: dict, reps: int, warmup: int = 2) -> dict:
    """CUDA-event medians (ms) of each of `fns` ({name: fn}), timed call by
    call in turn (rep 1 of every fn, then rep 2, ...), so clock and thermal
    drift hit each alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def flops(kind, layers, units, batch, steps, inputs):
    g = 4 if kind == "lstm" else 3
    return 2.0 * steps * batch * g * units * ((inputs + units) + (layers - 1) * 2 * units)


def bench_cell(kind, layers, units, batch, steps, dtype_name, reps, modes=(0,), cudnn=True,
               variants=(0,)):
    """One cell's timings. `variants` (the forward step's, wavefront.cuh):
    one, or several timed interleaved (`time_interleaved`): kernel_only_ms
    and kernel_ms are the first's, kernel_only_ms_v{N} and kernel_ms_v{N}
    each one's, ratio_* = variant N's / the first's."""
    dtype = DTYPES[dtype_name]
    inputs = units
    gen = torch.Generator(device="cuda").manual_seed(1)
    mod = make_module(kind, layers, units, inputs, dtype, gen)
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").to(dtype)
    h0 = torch.zeros(layers, batch, units, device="cuda", dtype=dtype)
    c0 = torch.zeros_like(h0)
    row = dict(kind=kind, layers=layers, units=units, batch=batch, steps=steps, dtype=dtype_name)
    reason = wavefront.unsupported_reason(kind, layers, units, batch, steps, inputs, dtype,
                                          torch.device("cuda"))
    params = wavefront.flat_params(mod).contiguous()
    gh = (4 if kind == "lstm" else 3) * units
    lib = library.load()
    if reason is None:
        dev = lib.device(torch.cuda.current_device())
        row["plan"] = lib.plan_layers(kind, layers, units, batch, steps, inputs, sms=dev["sms"],
                                      smem=dev["smem"])
        xproj = (x.reshape(-1, inputs) @ params[: gh * inputs].view(gh, inputs).t()).view(steps, batch, gh)
        y = torch.empty(steps, batch, units, dtype=dtype, device="cuda")
        hy, cy = torch.empty_like(h0), torch.empty_like(h0)
        ws = torch.empty(lib.workspace_bytes(layers, units, batch, steps), dtype=torch.uint8, device="cuda")
        v0 = variants[0]
        for mode in modes:
            def only_kernel(mode=mode, variant=v0):
                wavefront.forward_into(xproj, params, h0, c0, None, y, hy, cy, ws, kind=kind,
                                       input_size=inputs, mode=mode, variant=variant)
            if mode or len(variants) == 1:
                row[f"kernel_ms_mode{mode}" if mode else "kernel_only_ms"] = time_ms(only_kernel, reps)
        if len(variants) == 1:
            row["kernel_ms"] = time_ms(
                lambda: wavefront.forward(x, params, h0, c0, None, kind=kind, variant=v0), reps)
        else:
            row["variants"] = list(variants)
            only = time_interleaved(
                {v: functools.partial(wavefront.forward_into, xproj, params, h0, c0, None, y, hy,
                                      cy, ws, kind=kind, input_size=inputs, variant=v)
                 for v in variants}, reps)
            full = time_interleaved(
                {v: functools.partial(wavefront.forward, x, params, h0, c0, None, kind=kind,
                                      variant=v) for v in variants}, reps)
            for v in variants:
                row[f"kernel_only_ms_v{v}"], row[f"kernel_ms_v{v}"] = only[v], full[v]
                row[f"us_per_step_v{v}"] = 1000 * only[v] / (steps + layers - 1)
                if v != v0:
                    row[f"ratio_kernel_only_v{v}"] = only[v] / only[v0]
                    row[f"ratio_kernel_v{v}"] = full[v] / full[v0]
            row["kernel_only_ms"], row["kernel_ms"] = only[v0], full[v0]
        row["us_per_step"] = 1000 * row["kernel_only_ms"] / (steps + layers - 1)
    else:
        row["kernel"] = reason
    if not cudnn:
        return row
    with torch.no_grad():
        state = (h0, c0) if kind == "lstm" else h0
        row["cudnn_fused_ms"] = time_ms(lambda: mod(x, state), reps)
        per = []
        for l in range(layers):
            cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
            m1 = cls(inputs if l == 0 else units, units, 1).cuda().to(dtype)
            for a, b in zip(m1._flat_weights, mod._flat_weights[4 * l: 4 * l + 4]):
                a.copy_(b)
            per.append(m1)

        def per_layer():
            h = x
            for l, m1 in enumerate(per):
                st = (h0[l:l + 1], c0[l:l + 1]) if kind == "lstm" else h0[l:l + 1]
                h, _ = m1(h, st)
            return h

        row["cudnn_per_layer_ms"] = time_ms(per_layer, reps)
    f = flops(kind, layers, units, batch, steps, inputs)
    row["gflop"] = f / 1e9
    row["floor_ms"] = f / (PEAK_TFLOPS * 1e9)
    if "kernel_ms" in row:
        row["kernel_tflops"] = f / (row["kernel_ms"] * 1e9)
        best = min(row["cudnn_fused_ms"], row["cudnn_per_layer_ms"])
        row["speedup_vs_best_cudnn"] = best / row["kernel_ms"]
    return row


HEADLINE = [("lstm", 4, 512, 64, 1000, "float16"), ("gru", 4, 512, 64, 1000, "float16"),
            ("lstm", 4, 512, 64, 1000, "bfloat16"), ("lstm", 1, 512, 64, 1000, "float16")]


def matrix_cells():
    """A subset of 2-8 layers x 256-1024 units x batch 1-128 x T 100-2000."""
    lstm = [(2, 256, 8, 1000), (2, 256, 64, 1000), (4, 256, 64, 1000), (8, 256, 64, 1000),
            (8, 256, 128, 1000), (2, 512, 8, 1000), (2, 512, 64, 1000), (4, 512, 1, 1000),
            (4, 512, 16, 1000), (4, 512, 128, 1000), (4, 512, 64, 100), (4, 512, 64, 2000),
            (1, 1024, 64, 1000), (2, 1024, 64, 1000), (8, 512, 64, 1000)]
    cells = [("lstm", *c, "float16") for c in lstm]
    return cells + [("gru", 4, 256, 64, 1000, "float16"), ("gru", 8, 256, 32, 500, "float16")]


def cmd_bench(args):
    cells = HEADLINE if args.cells == "headline" else matrix_cells()
    rows = []
    start = time.perf_counter()
    for cell in cells:
        if time.perf_counter() - start > args.budget:
            rows.append(dict(cell=list(cell), skipped="time budget"))
            continue
        try:
            row = bench_cell(*cell, reps=args.reps, cudnn=not args.kernel_only,
                             variants=_variants(args))
        except Exception as exc:  # noqa: BLE001
            row = dict(cell=list(cell), error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        _print_row(row)
        _dump(args.out, dict(meta=_meta(), results=rows))
    return 0


# Debug modes (wavefront.cuh): 1 no waits, 2 no products, 4 fence.sc before
# publishing, 8 no loads of h, 16 no pointwise step; sums combine them.
MODES = (0, 1, 2, 3, 4, 8, 16, 27)


def cmd_modes(args):
    """Where a step's time goes: the headline with waits and/or products left out."""
    rows = []
    for cell in (("lstm", 4, 512, 64, 1000, "float16"), ("lstm", 1, 512, 64, 1000, "float16"),
                 ("lstm", 4, 512, 8, 1000, "float16")):
        row = bench_cell(*cell, reps=args.reps, modes=MODES, variants=(args.variant,))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
        _dump(args.out, dict(meta=_meta(), results=rows))
    return 0


PHASES = ("wait", "stage", "multiply", "pointwise", "publish")


def trace_cell(kind, layers, units, batch, steps, dtype_name, trace_steps=300, skip=50,
               variant=0):
    """The kernel's own timeline: per-phase medians (ns) over steps
    [skip, trace_steps) for CTA 0 (layer 0) and the top layer's first CTA.
    (Variant 1's point 3 is after the second half's products, which the
    first half's pointwise step overlaps: its "multiply" holds that part of
    the pointwise step, its "pointwise" the second half's.)"""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(2)
    mod = make_module(kind, layers, units, units, dtype, gen)
    x = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
    h0 = torch.zeros(layers, batch, units, device="cuda", dtype=dtype)
    c0 = torch.zeros_like(h0)
    params = wavefront.flat_params(mod).contiguous()
    gh = (4 if kind == "lstm" else 3) * units
    xproj = (x.reshape(-1, units) @ params[: gh * units].view(gh, units).t()).view(steps, batch, gh)
    y = torch.empty(steps, batch, units, dtype=dtype, device="cuda")
    hy, cy = torch.empty_like(h0), torch.empty_like(h0)
    lib = library.load()
    ws = torch.empty(lib.workspace_bytes(layers, units, batch, steps), dtype=torch.uint8, device="cuda")
    trace = torch.zeros(2, trace_steps, 8, dtype=torch.int64, device="cuda")
    for _ in range(3):
        wavefront.forward_into(xproj, params, h0, c0, None, y, hy, cy, ws, kind=kind,
                               input_size=units, trace=trace, variant=variant)
    torch.cuda.synchronize()
    tr = trace.cpu().tolist()
    row = dict(kind=kind, layers=layers, units=units, batch=batch, steps=steps, dtype=dtype_name,
               variant=variant)
    for which, name in ((0, "layer0"), (1, "top")):
        steps_ns = [tr[which][t + 1][0] - tr[which][t][0] for t in range(skip, trace_steps - 1)]
        phases = {ph: statistics.median(tr[which][t][i + 1] - tr[which][t][i]
                                        for t in range(skip, trace_steps))
                  for i, ph in enumerate(PHASES)}
        clocks = [(tr[which][t][7] - tr[which][t][6]) / max(1, tr[which][t][5] - tr[which][t][0])
                  for t in range(skip, trace_steps)]
        row[name] = dict(step_ns=statistics.median(steps_ns), phases_ns=phases,
                         ghz=statistics.median(clocks))
    return row


def cmd_trace(args):
    rows = []
    cells = (("lstm", 4, 512, 64, 1000, "float16"), ("lstm", 1, 512, 64, 1000, "float16"),
             ("lstm", 4, 512, 8, 1000, "float16"))
    for cell in cells[: args.cells]:
        row = trace_cell(*cell, variant=args.variant)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _dump(args.out, dict(meta=_meta(), results=rows))
    return 0


# -- gradients (the backward kernel) -------------------------------------------------------

# ||grad - ref64|| / ||ref64|| bounds: the recurrence's rounding (the stored
# gate gradients, h in the dtype) compounds over T backward steps; the
# check also requires each tensor within twice cuDNN's own error or this.
GRAD_TOL = {"float16": 5e-3, "bfloat16": 4e-2}


def _grad_names(layers, kind="lstm"):
    names = ["dx", "dh0", "dc0"] if kind == "lstm" else ["dx", "dh0"]
    for l in range(layers):
        names += [f"w_ih{l}", f"w_hh{l}", f"b_ih{l}", f"b_hh{l}"]
    return names


def _grads(outputs, inputs, upstream):
    return [g for g in torch.autograd.grad(outputs, inputs, upstream)]


def grad_case(layers, units, batch, steps, inputs, dtype_name, with_lengths, kind="lstm", *,
              seed):
    """One LSTM's or GRU's outputs and gradients: the kernels, float64, cuDNN.
    A GRU has no c0/cy (and no reverse-wavefront backward: --backward stack
    is an error for it); its backward is the per-layer kernel."""
    if kind == "gru" and BACKWARD == "stack":
        raise ValueError("grad_case: the reverse-wavefront backward runs LSTM stacks only")
    lstm = kind == "lstm"
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mod = make_module(kind, layers, units, inputs, dtype, gen)
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").to(dtype)
    h0 = (torch.randn(layers, batch, units, generator=gen, device="cuda") * 0.5).to(dtype)
    c0 = (torch.randn(layers, batch, units, generator=gen, device="cuda") * 0.5).to(dtype)
    dy = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
    dhy = torch.randn(layers, batch, units, generator=gen, device="cuda").to(dtype)
    dcy = torch.randn(layers, batch, units, generator=gen, device="cuda").to(dtype)
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen, device="cuda")
        lengths[0] = steps
    row = dict(kind=kind, layers=layers, units=units, batch=batch, steps=steps, inputs=inputs,
               dtype=dtype_name, lengths=with_lengths, seed=seed, backward=BACKWARD)
    weights = [w.detach().clone().requires_grad_() for w in mod._flat_weights]
    leaves = [t.clone().requires_grad_() for t in ((x, h0, c0) if lstm else (x, h0))]
    upstream = [dy, dhy, dcy] if lstm else [dy, dhy]
    lens = lengths.to(torch.int32) if lengths is not None else None

    def kernels(**options):  # (x, params, h0, c0 or None, lengths) -> outputs, no None
        out = wavefront.trainable_forward(leaves[0], wavefront.flat_params(weights), leaves[1],
                                          leaves[2] if lstm else None, lens, kind=kind,
                                          **options)
        return [t for t in out if t is not None]

    if BACKWARD == "stack":
        reason = (wavefront.unsupported_reason("lstm", layers, units, batch, steps, inputs,
                                               dtype, torch.device("cuda"))
                  or library.backward_stack_reason("lstm", layers, units, batch, steps))
        options = dict(backward="stack",
                       recurrence=functools.partial(wavefront.backward_stack_kernel, check=True,
                                                    variant=VARIANT))
        if VARIANT:  # the variant the plan chose (it falls back where the asked one does not fit)
            dev = library.load().device(0)
            planned = library.load().backward_stack_plan(layers, units, batch, steps,
                                                         sms=dev["sms"], smem=dev["smem"],
                                                         variant=VARIANT)
            row["variant"] = planned if isinstance(planned, str) else planned["variant"]
        if reason is not None:  # the refusal comes from the backward pass's plan
            return refused_row(row, reason, lambda: _grads(kernels(**options), leaves + weights,
                                                           upstream))
    else:
        reason = wavefront.training_reason(kind, layers, units, batch, steps, inputs, dtype,
                                           torch.device("cuda"))
        options = dict(backward=BACKWARD)  # "layer", or "auto" (the default path)
        if reason is not None:
            return refused_row(row, reason, lambda: kernels(**options))
    t0 = time.perf_counter()
    out = kernels(**options)
    got = _grads(out, leaves + weights, upstream)
    torch.cuda.synchronize()
    # float64: the same rounded weights, inputs and upstream gradients.
    w64 = [w.detach().double().requires_grad_() for w in weights]
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = [t for t in wavefront.reference_forward(kind, w64, l64[0], l64[1],
                                                      l64[2] if lstm else None, lengths)
               if t is not None]
    ref = _grads(ref_out, l64 + w64, [u.double() for u in upstream])
    # cuDNN in the same dtype.
    cl = [t.detach().clone().requires_grad_() for t in leaves]
    state = (cl[1], cl[2]) if lstm else cl[1]
    if lengths is None:
        cy_, cst = mod(cl[0], state)
    else:
        packed = torch.nn.utils.rnn.pack_padded_sequence(cl[0], lengths.cpu(), enforce_sorted=False)
        yp, cst = mod(packed, state)
        cy_, _ = torch.nn.utils.rnn.pad_packed_sequence(yp, total_length=steps)
    cud_out = [cy_, *cst] if lstm else [cy_, cst]
    cud = _grads(cud_out, cl + list(mod._flat_weights), upstream)
    names = _grad_names(layers, kind)
    err = {n: rel(a, b) for n, a, b in zip(("y", "hy", "cy"), out, ref_out)}
    cud_err = {n: rel(a, b) for n, a, b in zip(("y", "hy", "cy"), cud_out, ref_out)}
    err.update({n: rel(a, b) for n, a, b in zip(names, got, ref)})
    cud_err.update({n: rel(a, b) for n, a, b in zip(names, cud, ref)})
    tol = GRAD_TOL[dtype_name]
    bad = [n for n in err if not (math.isfinite(err[n]) and err[n] <= max(tol, 2 * cud_err[n]))]
    row.update(status="ok" if not bad else "FAIL", failing=bad,
               worst=max(err.values()), cudnn_worst=max(cud_err.values()),
               ratio_to_cudnn=max(err[n] / max(cud_err[n], 1e-12) for n in err),
               err_vs_f64=err, cudnn_err_vs_f64=cud_err,
               seconds=round(time.perf_counter() - t0, 2))
    return row


GRAD_CASES = [
    # layers, units, batch, steps, inputs, dtype, lengths
    (1, 64, 3, 7, 5, "float16", False),
    (1, 8, 1, 1, 3, "float16", False),
    (2, 256, 8, 50, 40, "float16", True),
    (2, 256, 8, 50, 40, "bfloat16", True),
    (3, 384, 33, 40, 100, "float16", True),
    (1, 1024, 16, 30, 1024, "float16", False),
    (4, 512, 256, 20, 512, "bfloat16", True),
    (4, 512, 64, 1000, 512, "float16", False),   # the headline
    (4, 512, 64, 300, 512, "bfloat16", True),
    (8, 512, 64, 10, 512, "float16", False),     # outside the forward's limits: refused
]


# Added with --backward stack: a deep stack (8 layers: 7 hand-offs down),
# tiny shapes, and one the forward runs but the stack backward refuses
# (7 x 320: 140 CTAs of 16 units; the forward's plan holds it on 130).
STACK_GRAD_CASES = [
    (8, 256, 16, 30, 256, "bfloat16", True),
    (8, 256, 64, 200, 256, "float16", False),
    (2, 8, 3, 5, 3, "float16", True),
    (3, 24, 9, 1, 7, "float16", False),
    (7, 320, 8, 10, 64, "float16", False),       # refused by the stack backward's plan
]


# A GRU's gradients (the per-layer backward; `grad` runs them unless
# --backward stack): the LSTM's shapes, and one the forward refuses.
GRU_GRAD_CASES = [
    (1, 64, 3, 7, 5, "float16", False, "gru"),
    (1, 8, 1, 1, 3, "float16", False, "gru"),
    (2, 256, 8, 50, 40, "float16", True, "gru"),
    (2, 256, 8, 50, 40, "bfloat16", True, "gru"),
    (3, 384, 33, 40, 100, "float16", True, "gru"),
    (1, 1024, 16, 30, 1024, "float16", False, "gru"),
    (4, 512, 256, 20, 512, "bfloat16", True, "gru"),
    (4, 512, 64, 1000, 512, "float16", False, "gru"),   # the headline
    (8, 256, 16, 30, 256, "bfloat16", True, "gru"),
    (8, 512, 64, 10, 512, "float16", False, "gru"),     # outside the forward's limits: refused
]


def random_grad_cases(n: int, seed: int, kind: str = "lstm"):
    """Random shapes that fit the forward (the backward's limits are wider);
    a GRU's cases carry the kind as their last item."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        layers, top = rng.choice([(rng.randint(1, 4), 512), (rng.randint(1, 8), 256), (1, 1024)])
        units = rng.choice([u for u in (8, 64, 128, 200, 256, 320, 384, 512, 1024) if u <= top])
        cases.append((layers, units, rng.choice([1, 2, 5, 16, 33, 64, 100]),
                      rng.randint(1, 120), rng.choice([units, 32, 300]),
                      rng.choice(["float16", "bfloat16"]), rng.random() < 0.5))
    return cases if kind == "lstm" else [c + (kind,) for c in cases]


BACKWARD = "layer"  # grad and train: --backward
VARIANT = 0  # grad and train: --variant (the stack backward's kernel variant)
VARIANTS = ()  # train: --variants (timed interleaved)


def cmd_grad(args):
    global BACKWARD, VARIANT
    BACKWARD, VARIANT = args.backward, args.variant
    cases = GRAD_CASES[: args.fixed] + random_grad_cases(args.random, args.seed)
    if BACKWARD == "stack":
        cases += STACK_GRAD_CASES
    elif "gru" in args.kinds.split(","):  # the reverse wavefront is LSTM only
        cases += GRU_GRAD_CASES[: args.fixed] + random_grad_cases(args.random, args.seed + 1,
                                                                  kind="gru")
    if "lstm" not in args.kinds.split(","):
        cases = [c for c in cases if c[-1] == "gru"]
    return run_cases("grad", cases, grad_case, args.seed,
                     ("status", "failing", "worst", "cudnn_worst", "ratio_to_cudnn", "reason",
                      "seconds"), args.out)


def train_cell(layers, units, batch, steps, dtype_name, reps, kind="lstm"):
    """A training step (forward + every gradient) on the kernels and on cuDNN."""
    if kind == "gru":
        return train_cell_gru(layers, units, batch, steps, dtype_name, reps)
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(3)
    mod = make_module("lstm", layers, units, units, dtype, gen)
    x = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
    h0 = torch.zeros(layers, batch, units, device="cuda", dtype=dtype)
    c0 = torch.zeros_like(h0)
    dy = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
    row = dict(layers=layers, units=units, batch=batch, steps=steps, dtype=dtype_name)
    params = wavefront.flat_params(mod).detach().clone()
    leaves = [t.clone().requires_grad_() for t in (x, params, h0, c0)]

    def ours():
        y, _, _ = wavefront.trainable_forward(*leaves, backward="layer")
        return torch.autograd.grad([y], leaves, [dy])

    cl = [t.clone().requires_grad_() for t in (x, h0, c0)]

    def cudnn():
        y, _ = mod(cl[0], (cl[1], cl[2]))
        return torch.autograd.grad([y], cl + list(mod._flat_weights), [dy])

    with torch.no_grad():
        row["ours_forward_inference_ms"] = time_ms(
            lambda: wavefront.forward(x, params, h0, c0, None, kind="lstm"), reps)
        row["ours_forward_saving_ms"] = time_ms(
            lambda: wavefront.forward_training(x, params, h0, c0, None), reps)
        y, hy, cy, saved = wavefront.forward_training(x, params, h0, c0, None)
        row["ours_backward_ms"] = time_ms(
            lambda: wavefront.backward_stack(params, x, h0, c0, None, y, saved, dy, None, None),
            reps)
        views = wavefront._layer_views(params, layers, units, units)
        row["ours_recurrence_one_layer_ms"] = time_ms(
            lambda: wavefront.backward_layer(views[-1][1].contiguous(), saved[1][-1], saved[2][-1],
                                             c0[-1], dy, torch.zeros_like(h0[-1]),
                                             torch.zeros_like(c0[-1]), None), reps)
    row["ours_train_step_ms"] = time_ms(ours, reps)
    row["cudnn_train_step_ms"] = time_ms(cudnn, reps)
    with torch.no_grad():
        row["cudnn_forward_inference_ms"] = time_ms(lambda: mod(x, (h0, c0)), reps)
    row["speedup_vs_cudnn"] = row["cudnn_train_step_ms"] / row["ours_train_step_ms"]
    if BACKWARD == "stack":
        row.update(train_stack(layers, units, leaves, x, params, h0, c0, dy, ours, reps))
        row["speedup_vs_cudnn_stack"] = (row["cudnn_train_step_ms"]
                                         / row["ours_train_step_stack_ms"])
    return row


def train_cell_gru(layers, units, batch, steps, dtype_name, reps):
    """`train_cell` of a GRU stack: its per-layer backward (the reverse
    wavefront is LSTM only) against cuDNN's (torch.nn.GRU, torch._VF.gru)."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(3)
    mod = make_module("gru", layers, units, units, dtype, gen)
    x = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
    h0 = torch.zeros(layers, batch, units, device="cuda", dtype=dtype)
    dy = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
    row = dict(kind="gru", layers=layers, units=units, batch=batch, steps=steps,
               dtype=dtype_name)
    params = wavefront.flat_params(mod).detach().clone()
    leaves = [t.clone().requires_grad_() for t in (x, params, h0)]

    def ours():
        y, _, _ = wavefront.trainable_forward(leaves[0], leaves[1], leaves[2], None,
                                              backward="layer", kind="gru")
        return torch.autograd.grad([y], leaves, [dy])

    cl = [t.clone().requires_grad_() for t in (x, h0)]

    def cudnn():
        y, _ = mod(cl[0], cl[1])
        return torch.autograd.grad([y], cl + list(mod._flat_weights), [dy])

    with torch.no_grad():
        row["ours_forward_inference_ms"] = time_ms(
            lambda: wavefront.forward(x, params, h0, None, None, kind="gru"), reps)
        row["ours_forward_saving_ms"] = time_ms(
            lambda: wavefront.forward_training(x, params, h0, None, None, kind="gru"), reps)
        y, hy, _, saved = wavefront.forward_training(x, params, h0, None, None, kind="gru")
        row["ours_backward_ms"] = time_ms(
            lambda: wavefront.backward_stack(params, x, h0, None, None, y, saved, dy, None, None,
                                             kind="gru"), reps)
        views = wavefront._layer_views(params, layers, units, units, gates=3)
        row["ours_recurrence_one_layer_ms"] = time_ms(
            lambda: wavefront.backward_layer(views[-1][1].contiguous(), saved[1][-1],
                                             saved[2][-1], None, dy, torch.zeros_like(h0[-1]),
                                             None, None, kind="gru"), reps)
    row["ours_train_step_ms"] = time_ms(ours, reps)
    row["cudnn_train_step_ms"] = time_ms(cudnn, reps)
    with torch.no_grad():
        row["cudnn_forward_inference_ms"] = time_ms(lambda: mod(x, h0), reps)
    row["speedup_vs_cudnn"] = row["cudnn_train_step_ms"] / row["ours_train_step_ms"]
    return row


def train_stack(layers, units, leaves, x, params, h0, c0, dy, ours, reps):
    """The reverse-wavefront backward beside the layer-by-layer one: its
    gradients against the layer path's (max over tensors of ||a - b|| /
    ||b||; a timed-out wait is an error), the backward, the kernel alone and
    the training step, in ms."""
    out = {}
    zeros = torch.zeros_like(h0)
    with torch.no_grad():
        y, hy, cy, saved = wavefront.forward_training(x, params, h0, c0, None)
        checked = functools.partial(wavefront.backward_stack_kernel, check=True,
                                    variant=VARIANT)
        got = wavefront.backward_stack_wavefront(params, x, h0, c0, None, y, saved, dy, None,
                                                 None, recurrence=checked)
        want = wavefront.backward_stack(params, x, h0, c0, None, y, saved, dy, None, None)
        out["stack_vs_layer_rel"] = {n: rel(a, b) for n, a, b in
                                     zip(("dx", "dparams", "dh0", "dc0"), got, want)}
        unchecked = functools.partial(wavefront.backward_stack_kernel, variant=VARIANT)
        out["ours_backward_stack_ms"] = time_ms(
            lambda: wavefront.backward_stack_wavefront(params, x, h0, c0, None, y, saved, dy,
                                                       None, None, recurrence=unchecked), reps)
        out["ours_recurrence_stack_ms"] = time_ms(
            lambda: unchecked(params, x.shape[-1], saved[1], saved[2], c0, dy, zeros, zeros,
                              None), reps)

    def ours_stack():
        y, _, _ = wavefront.trainable_forward(*leaves, backward="stack", recurrence=unchecked)
        return torch.autograd.grad([y], leaves, [dy])

    a, b = ours_stack(), ours()
    out["train_step_stack_vs_layer_rel"] = max(rel(p, q) for p, q in zip(a, b))
    out["ours_train_step_stack_ms"] = time_ms(ours_stack, reps)
    if VARIANTS:
        out["variants"] = train_variants(leaves, x, params, h0, c0, dy, y, saved, reps)
    return out


def train_variants(leaves, x, params, h0, c0, dy, y, saved, reps, rounds=5):
    """Each of VARIANTS's recurrence (the stack kernel alone), backward
    (kernel + GEMMs) and training step, timed interleaved: `rounds` rounds,
    each a `time_ms` median of every variant in turn; the median of the
    rounds in ms, the ratio to the first variant's, the variant the plan
    chose, and its dgates' largest difference from the first's."""
    layers, steps, batch, units = saved[2].shape
    zeros = torch.zeros_like(h0)
    dev = library.load().device(0)
    kernels = {v: functools.partial(wavefront.backward_stack_kernel, variant=v) for v in VARIANTS}
    out, first = {}, None
    with torch.no_grad():
        for v in VARIANTS:
            planned = library.load().backward_stack_plan(layers, units, batch, steps,
                                                         sms=dev["sms"], smem=dev["smem"],
                                                         variant=v)
            dg = wavefront.backward_stack_kernel(params, x.shape[-1], saved[1], saved[2], c0, dy,
                                                 zeros, zeros, None, check=True, variant=v)[0]
            first = dg if first is None else first
            out[v] = dict(planned=planned if isinstance(planned, str) else planned.get("variant", 0),
                          dgates_max_abs_vs_first=float((dg.float() - first.float()).abs().max()))

    def recurrence(v):
        with torch.no_grad():
            kernels[v](params, x.shape[-1], saved[1], saved[2], c0, dy, zeros, zeros, None)

    def backward(v):
        with torch.no_grad():
            wavefront.backward_stack_wavefront(params, x, h0, c0, None, y, saved, dy, None, None,
                                               recurrence=kernels[v])

    def train_step(v):
        yy, _, _ = wavefront.trainable_forward(*leaves, backward="stack", recurrence=kernels[v])
        return torch.autograd.grad([yy], leaves, [dy])

    for name, fn in (("recurrence_ms", recurrence), ("backward_ms", backward),
                     ("train_step_ms", train_step)):
        times = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for v in VARIANTS:
                times[v].append(time_ms(functools.partial(fn, v), reps, warmup=1))
        for v in VARIANTS:
            out[v][name] = statistics.median(times[v])
            out[v][name.replace("_ms", "_ratio")] = out[v][name] / statistics.median(
                times[VARIANTS[0]])
    return {str(v): r for v, r in out.items()}


def cmd_train(args):
    global BACKWARD, VARIANT, VARIANTS
    BACKWARD, VARIANT = args.backward, args.variant
    VARIANTS = tuple(int(v) for v in args.variants.split(",")) if args.variants else ()
    if VARIANTS and BACKWARD != "stack":
        raise SystemExit("train --variants times the stack backward: add --backward stack")
    rows = []
    cells = [(4, 512, 64, 1000, "float16"), (4, 512, 64, 1000, "bfloat16"),
             (2, 256, 8, 1000, "float16")]
    kinds = args.kinds.split(",")
    if "gru" in kinds and BACKWARD == "stack":
        raise SystemExit("train --backward stack times the reverse wavefront: LSTM only")
    for cell in [(*c, k) for k in kinds for c in cells[: args.cells]]:
        try:
            row = train_cell(*cell[:5], reps=args.reps, kind=cell[5])
        except Exception as exc:  # noqa: BLE001
            row = dict(cell=list(cell), error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        _dump(args.out, dict(meta=_meta(), results=rows))
    return 0


# Stacks larger than the chip (docs/kernel.md, "Stacks larger than the chip"):
# refused whole, run as consecutive segments that each fit.
SEGMENT_CELLS = [("lstm", 8, 512, 32, 1000, "float16"), ("lstm", 2, 1024, 16, 1500, "float16")]


def _segment_params(mod, start, stop):
    """The canonical flat buffer of layers [start, stop) of `mod`."""
    return wavefront.flat_params(mod._flat_weights[4 * start:4 * stop]).contiguous()


def segments_forward(kind, mod, pieces, x, h0, c0, params=None, train=False):
    """The stack as consecutive kernel launches, one a segment (`pieces`);
    each segment's input is the previous one's output. `params`: each
    segment's flat buffer (default: from `mod`); `train`: each segment on
    `trainable_forward` (the kernels' backward in autograd)."""
    start, y, hys, cys = 0, x, [], []
    for i, size in enumerate(pieces):
        stop = start + size
        p = params[i] if params is not None else _segment_params(mod, start, stop)
        c = c0[start:stop] if kind == "lstm" else None
        if train:
            y, hy, cy = wavefront.trainable_forward(y, p, h0[start:stop], c, None, kind=kind)
        else:
            y, hy, cy = wavefront.forward(y, p, h0[start:stop].contiguous(),
                                          None if c is None else c.contiguous(), None, kind=kind)
        hys.append(hy)
        cys.append(cy)
        start = stop
    return y, torch.cat(hys), (torch.cat(cys) if kind == "lstm" else None)


def segments_cell(kind, layers, units, batch, steps, dtype_name, reps, train=False):
    """One stack larger than the chip: its segmentation on this GPU's plan
    (`segments.stack_segments`), the segmented forward's error against
    float64 and cuDNN's, and CUDA-event medians, timed interleaved, of the
    segmented kernel, cuDNN as one multi-layer call and cuDNN a layer at a
    time (where torch runs cuDNN's persistent kernel in float16); with
    `train`, the training step (forward + every gradient) of each."""
    from rnnfuse.backends.cuda import segments

    dtype = DTYPES[dtype_name]
    inputs = units
    gen = torch.Generator(device="cuda").manual_seed(5)
    mod = make_module(kind, layers, units, inputs, dtype, gen)
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").to(dtype)
    h0 = (0.5 * torch.randn(layers, batch, units, generator=gen, device="cuda")).to(dtype)
    c0 = (0.5 * torch.randn(layers, batch, units, generator=gen, device="cuda")).to(dtype)
    lib = library.load()
    dev = lib.device(torch.cuda.current_device())
    row = dict(kind=kind, layers=layers, units=units, batch=batch, steps=steps, dtype=dtype_name,
               whole=lib.plan(kind, layers, units, batch, steps, inputs, sms=dev["sms"],
                              smem=dev["smem"]))
    pieces = segments.stack_segments(lib, kind, layers, units, batch, steps, inputs,
                                     sms=dev["sms"], smem=dev["smem"], training=train)
    if isinstance(pieces, str):
        row["kernel"] = pieces
        return row
    row["pieces"] = list(pieces)
    row["dependent_steps"] = steps * len(pieces) + layers - len(pieces)
    cstate = (h0, c0) if kind == "lstm" else h0
    with torch.no_grad():
        y, hy, cy = segments_forward(kind, mod, pieces, x, h0, c0)
        ry, rhy, rcy = reference(kind, mod, x, h0, c0, None)
        dy_, dhy, dcy = cudnn_forward(kind, mod, x, h0, c0, None)
        row["err_y"], row["err_hy"] = rel(y, ry), rel(hy, rhy)
        row["cudnn_err_y"], row["cudnn_err_hy"] = rel(dy_, ry), rel(dhy, rhy)
        if kind == "lstm":
            row["err_cy"], row["cudnn_err_cy"] = rel(cy, rcy), rel(dcy, rcy)
        row["status"] = "ok" if max(row["err_y"], row["err_hy"]) <= TOL[dtype_name] else "wrong"
        per = []
        for l in range(layers):
            cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
            m1 = cls(inputs if l == 0 else units, units, 1).cuda().to(dtype)
            for a, b in zip(m1._flat_weights, mod._flat_weights[4 * l: 4 * l + 4]):
                a.copy_(b)
            per.append(m1)

        def per_layer():
            h = x
            for l, m1 in enumerate(per):
                st = (h0[l:l + 1], c0[l:l + 1]) if kind == "lstm" else h0[l:l + 1]
                h, _ = m1(h, st)
            return h

        seg_params, start = [], 0
        for size in pieces:
            seg_params.append(_segment_params(mod, start, start + size))
            start += size
        times = time_interleaved({
            "kernel_segments": lambda: segments_forward(kind, mod, pieces, x, h0, c0, seg_params),
            "cudnn_fused": lambda: mod(x, cstate),
            "cudnn_per_layer": per_layer,
        }, reps)
    row.update({f"{k}_ms": v for k, v in times.items()})
    best = min(times["cudnn_fused"], times["cudnn_per_layer"])
    row["speedup_vs_best_cudnn"] = best / times["kernel_segments"]
    row["us_per_step"] = 1000 * times["kernel_segments"] / row["dependent_steps"]
    f = flops(kind, layers, units, batch, steps, inputs)
    row["gflop"], row["floor_ms"] = f / 1e9, f / (PEAK_TFLOPS * 1e9)
    row["kernel_tflops"] = f / (times["kernel_segments"] * 1e9)
    if train:
        dy = torch.randn(steps, batch, units, generator=gen, device="cuda").to(dtype)
        leaves = [p.clone().requires_grad_() for p in seg_params]
        xs = x.clone().requires_grad_()

        def ours():
            y, _, _ = segments_forward(kind, mod, pieces, xs, h0, c0, leaves, train=True)
            return torch.autograd.grad([y], [xs, *leaves], [dy])

        def cudnn():
            y, _ = mod(xs, cstate)
            return torch.autograd.grad([y], [xs, *mod._flat_weights], [dy])

        def cudnn_layers():
            h = xs
            for l, m1 in enumerate(per):
                st = (h0[l:l + 1], c0[l:l + 1]) if kind == "lstm" else h0[l:l + 1]
                h, _ = m1(h, st)
            return torch.autograd.grad([h], [xs, *[w for m1 in per for w in m1._flat_weights]],
                                       [dy])

        # The segments' gradients (dx, each segment's flat buffer) against
        # cuDNN's in the same dtype, ||ours - cuDNN|| / ||cuDNN||: a sanity
        # check of the wiring (grad checks them against float64).
        got, want = ours(), cudnn()
        errors, start = [rel(got[0], want[0])], 0
        for i, size in enumerate(pieces):
            ref = wavefront.flat_params(want[1 + 4 * start:1 + 4 * (start + size)])
            errors.append(rel(got[1 + i], ref))
            start += size
        row["train_grad_rel_vs_cudnn"] = max(errors)
        del got, want
        steps_ms = time_interleaved({"kernel_segments_train": ours, "cudnn_fused_train": cudnn,
                                     "cudnn_per_layer_train": cudnn_layers}, max(3, reps // 2))
        row.update({f"{k}_ms": v for k, v in steps_ms.items()})
        row["train_speedup_vs_best_cudnn"] = (
            min(steps_ms["cudnn_fused_train"], steps_ms["cudnn_per_layer_train"])
            / steps_ms["kernel_segments_train"])
    return row


# Bidirectional layers (docs/kernel.md, "Bidirectional layers"): one launch
# a layer, both directions concurrently. (kind, layers, units, inputs, batch, steps, dtype)
BIDIRECTIONAL_CELLS = [("lstm", 4, 384, 80, 24, 700, "float16"),
                       ("gru", 5, 512, 512, 32, 500, "float16")]


def _bidirectional_module():
    import importlib

    sys.modules.setdefault("rnnfuse.backends.torch.wavefront", wavefront)
    return importlib.import_module("rnnfuse.backends.torch.wavefront_bidirectional")


def bidirectional_cell(kind, layers, units, inputs, batch, steps, dtype_name, reps,
                       with_lengths=False, train=False):
    """One bidirectional stack on the kernel (`wavefront_bidirectional
    .forward`, one launch a layer): its error against float64 of the same
    rounded weights and cuDNN's (torch's bidirectional nn.LSTM/GRU in the
    same dtype), then CUDA-event medians, timed interleaved, of the kernel,
    cuDNN as one multi-layer call and cuDNN a layer at a time."""
    import copy

    bidir = _bidirectional_module()
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(7)
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    mod = cls(inputs, units, layers, bidirectional=True).cuda()
    bound = 1.0 / math.sqrt(units)
    with torch.no_grad():
        for w in mod._flat_weights:
            w.copy_((torch.rand(w.shape, generator=gen, device="cuda") * 2 - 1) * bound)
    mod = mod.to(dtype)
    ref = copy.deepcopy(mod).double()
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").to(dtype)
    h0 = (0.5 * torch.randn(2 * layers, batch, units, generator=gen, device="cuda")).to(dtype)
    c0 = (0.5 * torch.randn(2 * layers, batch, units, generator=gen, device="cuda")).to(dtype)
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen, device="cuda")
        lengths[0] = steps
    lib = library.load()
    dev = lib.device(torch.cuda.current_device())
    row = dict(kind=kind, layers=layers, units=units, inputs=inputs, batch=batch, steps=steps,
               dtype=dtype_name, lengths=with_lengths,
               plan=[lib.plan_directions(kind, units, batch, steps, width, sms=dev["sms"],
                                         smem=dev["smem"]) for width in (inputs, 2 * units)])

    def run(m, x, h0, c0):
        state = (h0, c0) if kind == "lstm" else h0
        if lengths is None:
            y, st = m(x, state)
        else:
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(),
                                                             enforce_sorted=False)
            yp, st = m(packed, state)
            y, _ = torch.nn.utils.rnn.pad_packed_sequence(yp, total_length=steps)
        return (y, *st) if kind == "lstm" else (y, st, None)

    with torch.no_grad():
        y, hy, cy = bidir.forward(x, mod._flat_weights, h0, c0, lengths, kind=kind)
        ry, rhy, rcy = run(ref, x.double(), h0.double(), c0.double())
        dy_, dhy, dcy = run(mod, x, h0, c0)
        row["err_y"], row["err_hy"] = rel(y, ry), rel(hy, rhy)
        row["cudnn_err_y"], row["cudnn_err_hy"] = rel(dy_, ry), rel(dhy, rhy)
        if kind == "lstm":
            row["err_cy"], row["cudnn_err_cy"] = rel(cy, rcy), rel(dcy, rcy)
        worst = max(v for k, v in row.items() if k.startswith("err_"))
        row["status"] = "ok" if worst <= TOL[dtype_name] else "wrong"
        if with_lengths:
            return row
        per = []
        for l in range(layers):
            m1 = cls(inputs if l == 0 else 2 * units, units, 1, bidirectional=True).cuda().to(dtype)
            for a, b in zip(m1._flat_weights, mod._flat_weights[8 * l: 8 * l + 8]):
                a.copy_(b)
            per.append(m1)

        def per_layer():
            h = x
            for l, m1 in enumerate(per):
                st = ((h0[2 * l:2 * l + 2], c0[2 * l:2 * l + 2]) if kind == "lstm"
                      else h0[2 * l:2 * l + 2])
                h, _ = m1(h, st)
            return h

        cstate = (h0, c0) if kind == "lstm" else h0
        times = time_interleaved({
            "kernel": lambda: bidir.forward(x, mod._flat_weights, h0, c0, None, kind=kind),
            "cudnn_fused": lambda: mod(x, cstate),
            "cudnn_per_layer": per_layer,
        }, reps)
    row.update({f"{k}_ms": v for k, v in times.items()})
    best = min(times["cudnn_fused"], times["cudnn_per_layer"])
    row["speedup_vs_best_cudnn"] = best / times["kernel"]
    row["us_per_step"] = 1000 * times["kernel"] / (layers * steps)
    if train:
        # A training step (forward + every gradient): the training form (a
        # one-layer launch a direction), its directions one after the other
        # and on two streams, against cuDNN's bidirectional call.
        dy = torch.randn(steps, batch, 2 * units, generator=gen, device="cuda").to(dtype)
        xs = x.clone().requires_grad_()
        leaves = [w.detach().clone().requires_grad_() for w in mod._flat_weights]
        hc = (h0, c0 if kind == "lstm" else None)

        def ours(concurrent):
            def step():
                y, _, _ = bidir.trainable_forward(xs, leaves, *hc, None, kind=kind,
                                                  concurrent=concurrent)
                return torch.autograd.grad([y], [xs, *leaves], [dy])
            return step

        def cudnn():
            y, _ = mod(xs, cstate)
            return torch.autograd.grad([y], [xs, *mod._flat_weights], [dy])

        fns = {"kernel_train": ours(False), "kernel_concurrent_train": ours(True),
               "cudnn_fused_train": cudnn}
        got, both, want = fns["kernel_train"](), fns["kernel_concurrent_train"](), cudnn()
        row["train_grad_rel_vs_cudnn"] = max(rel(g, w) for g, w in zip(got, want))
        row["train_concurrent_grad_rel_vs_cudnn"] = max(rel(g, w) for g, w in zip(both, want))
        row["train_concurrent_rel_vs_sequential"] = max(rel(g, w) for g, w in zip(both, got))
        row["train_concurrent_bit_identical"] = all(torch.equal(g, w) for g, w in zip(both, got))
        del got, both, want
        steps_ms = time_interleaved(fns, max(3, reps // 2))
        row.update({f"{k}_ms": v for k, v in steps_ms.items()})
        row["train_speedup_vs_cudnn"] = steps_ms["cudnn_fused_train"] / steps_ms["kernel_train"]
        row["train_concurrent_speedup_vs_cudnn"] = (steps_ms["cudnn_fused_train"]
                                                    / steps_ms["kernel_concurrent_train"])
        row["train_concurrent_speedup_vs_sequential"] = (
            steps_ms["kernel_train"] / steps_ms["kernel_concurrent_train"])
    g = 4 if kind == "lstm" else 3
    f = 2.0 * 2 * steps * batch * g * units * ((inputs + units) + (layers - 1) * 3 * units)
    row["gflop"], row["floor_ms"] = f / 1e9, f / (PEAK_TFLOPS * 1e9)
    row["kernel_tflops"] = f / (times["kernel"] * 1e9)
    return row


def cmd_bidirectional(args):
    """Bidirectional stacks: `bidirectional_cell` for BIDIRECTIONAL_CELLS,
    with lengths (exactness only) and without (exactness and timings)."""
    rows = []
    for cell in BIDIRECTIONAL_CELLS:
        for with_lengths in (True, False):
            try:
                row = bidirectional_cell(*cell, reps=args.reps, with_lengths=with_lengths,
                                         train=args.train and not with_lengths)
            except Exception as exc:  # noqa: BLE001
                row = dict(cell=list(cell), lengths=with_lengths,
                           error=f"{type(exc).__name__}: {exc}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            _dump(args.out, dict(meta=_meta(), results=rows))
    return 0


def cmd_segments(args):
    """Stacks larger than the chip: `segments_cell` for SEGMENT_CELLS."""
    rows = []
    for cell in SEGMENT_CELLS:
        try:
            row = segments_cell(*cell, reps=args.reps, train=args.train)
        except Exception as exc:  # noqa: BLE001
            row = dict(cell=list(cell), error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        _dump(args.out, dict(meta=_meta(), results=rows))
    return 0


# --- sweep: randomized exactness over the brief's ranges ---------------------
# A case's float64 reference must stay small enough to run in seconds:
# T * B * H elements of one sequence (float64), and steps x layers.
SWEEP_MAX_ELEMENTS = 6e7
SWEEP_MAX_LAYER_STEPS = 8000
# ... and its products: directions x layers x T x B x H^2 (a float64 stack
# of 4 x 512 at batch 64 and T 2000 is 1.3e11).
SWEEP_MAX_WORK = 5e11


def sweep_cases(n: int, seed: int):
    """`n` random shapes over 1-8 layers, 64-1024 units (a tenth not a
    multiple of 8), batch 1-256, T 1-2000 (log-uniform), with and without
    lengths, unidirectional and bidirectional, LSTM and GRU, float16 and
    bfloat16; T shrunk where the float64 reference would be too large
    (SWEEP_MAX_*)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        layers = rng.randint(1, 8)
        if rng.random() < 0.1:
            units = rng.randint(64, 1024)
        else:
            units = 8 * rng.randint(8, 128)
        batch = int(round(math.exp(rng.uniform(0, math.log(256)))))
        steps = int(round(math.exp(rng.uniform(0, math.log(2000)))))
        directions = rng.choice([1, 2])
        width = directions * units
        steps = max(1, min(steps, int(SWEEP_MAX_ELEMENTS // (batch * width)),
                           SWEEP_MAX_LAYER_STEPS // layers,
                           int(SWEEP_MAX_WORK // (directions * layers * batch * units ** 2))))
        cases.append((rng.choice(["lstm", "gru"]), directions, layers, units, batch, steps,
                      rng.choice([units, 80, 300]), rng.choice(["float16", "bfloat16"]),
                      rng.random() < 0.5))
    return cases


def _lengths_for(steps, batch, gen):
    lengths = torch.randint(1, steps + 1, (batch,), generator=gen, device="cuda")
    lengths[0] = steps  # the padded output keeps T steps
    return lengths


def _segmented(kind, mod, pieces, x, h0, c0, lengths):
    """`segments_forward` with lengths: each segment's launch reads the
    previous one's output, zero past each length, as the fused call does."""
    start, y, hys, cys = 0, x, [], []
    for size in pieces:
        stop = start + size
        c = c0[start:stop].contiguous() if kind == "lstm" else None
        y, hy, cy = wavefront.forward(y, _segment_params(mod, start, stop),
                                      h0[start:stop].contiguous(), c, lengths, kind=kind)
        hys.append(hy)
        cys.append(cy)
        start = stop
    return y, torch.cat(hys), (torch.cat(cys) if kind == "lstm" else None)


def _bidirectional_reason(lib, dev, kind, layers, units, batch, steps, inputs):
    """The kernel's plan for a bidirectional stack's layers (the switch
    `library.BIDIRECTIONAL` aside: the sweep checks the opt-in path too)."""
    for width in {inputs} if layers == 1 else {inputs, 2 * units}:
        plan = lib.plan_directions(kind, units, batch, steps, width, sms=dev["sms"],
                                   smem=dev["smem"])
        if isinstance(plan, str):
            return plan
    return None


def sweep_case(kind, directions, layers, units, batch, steps, inputs, dtype_name, with_lengths,
               seed):
    """One shape the way a fused call meets it: the kernel where its plan
    takes the stack (bidirectional: each layer's two directions, opt-in),
    else consecutive segments where those fit (unidirectional), else cuDNN,
    which must then have been refused by the kernel with a reason
    (WavefrontError, nothing launched). Whatever runs is compared with
    float64 of the same rounded weights and with cuDNN; the row's `ratio`
    is its error over the tolerance (the check's: max(TOL, 2 x cuDNN's))."""
    import copy

    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    mod = cls(inputs, units, layers, bidirectional=directions == 2).cuda()
    bound = 1.0 / math.sqrt(units)
    with torch.no_grad():
        for w in mod._flat_weights:
            w.copy_((torch.rand(w.shape, generator=gen, device="cuda") * 2 - 1) * bound)
    mod = mod.to(dtype)
    pseudo = directions * layers
    x = torch.randn(steps, batch, inputs, generator=gen, device="cuda").to(dtype)
    h0 = (0.5 * torch.randn(pseudo, batch, units, generator=gen, device="cuda")).to(dtype)
    c0 = (0.5 * torch.randn(pseudo, batch, units, generator=gen, device="cuda")).to(dtype)
    lengths = _lengths_for(steps, batch, gen) if with_lengths else None
    row = dict(kind=kind, directions=directions, layers=layers, units=units, batch=batch,
               steps=steps, inputs=inputs, dtype=dtype_name, lengths=with_lengths, seed=seed)
    lib = library.load()
    dev = lib.device(torch.cuda.current_device())
    bidir = _bidirectional_module() if directions == 2 else None
    if directions == 1:
        reason = wavefront.unsupported_reason(kind, layers, units, batch, steps, inputs, dtype,
                                              torch.device("cuda"))
    else:
        reason = _bidirectional_reason(lib, dev, kind, layers, units, batch, steps, inputs)

    def kernel():
        if directions == 2:
            return bidir.forward(x, mod._flat_weights, h0, c0, lengths, kind=kind)
        return kernel_forward(kind, mod, x, h0, c0, lengths)

    with torch.no_grad():
        if reason is None:
            path, run = "kernel" if directions == 1 else "kernel-bidirectional", kernel
        else:
            row["reason"] = reason
            refused = refused_row({}, reason, kernel)
            if refused["status"] != "fallback":
                row.update(status="FAIL", path="kernel", error=refused["reason"])
                return row
            pieces = None
            if directions == 1 and units % 8 == 0:
                from rnnfuse.backends.cuda import segments

                pieces = segments.stack_segments(lib, kind, layers, units, batch, steps, inputs,
                                                 sms=dev["sms"], smem=dev["smem"])
            if isinstance(pieces, tuple) and len(pieces) > 1:
                path = "segments " + "+".join(map(str, pieces))
                run = functools.partial(_segmented, kind, mod, pieces, x, h0, c0, lengths)
            else:
                path, run = "cudnn", functools.partial(cudnn_forward, kind, mod, x, h0, c0,
                                                       lengths)
        t0 = time.perf_counter()
        y, hy, cy = run()
        torch.cuda.synchronize()
        if directions == 1:
            ref = reference(kind, mod, x, h0, c0, lengths)
        else:
            ref = cudnn_forward(kind, copy.deepcopy(mod).double(), x.double(), h0.double(),
                                c0.double(), lengths)
        cud = cudnn_forward(kind, mod, x, h0, c0, lengths)
    names = ("y", "hy", "cy") if kind == "lstm" else ("y", "hy")
    got = dict(zip(names, (y, hy, cy)))
    err = {k: rel(got[k], r) for k, r in zip(names, ref)}
    cudnn_err = {k: rel(c, r) for k, c, r in zip(names, cud, ref)}
    tol = max(TOL[dtype_name], 2 * max(cudnn_err.values()))
    worst = max(err.values())
    unwritten = sum(int(torch.isnan(t).sum()) for t in got.values())
    ok = unwritten == 0 and math.isfinite(worst) and worst <= tol
    row.update(path=path, status=("fallback" if path == "cudnn" else "ok") if ok else "FAIL",
               err_vs_f64=err, cudnn_err_vs_f64=cudnn_err, tol=tol, ratio=worst / tol,
               unwritten=unwritten, seconds=round(time.perf_counter() - t0, 2))
    return row


def _reason_key(reason: str) -> str:
    """A refusal's kind: its text up to the first number."""
    import re

    head = re.split(r"\d", reason, maxsplit=1)[0].rstrip(" :,(")
    return head[:70]


def sweep_summary(rows, seconds: float) -> str:
    """One line: cases, passed on each path, refused (with their reasons),
    failed, and the worst error over its tolerance."""
    from collections import Counter

    paths = Counter(r.get("path", "?").split(" ")[0] for r in rows if r["status"] == "ok")
    fell = [r for r in rows if r["status"] == "fallback"]
    bad = [r for r in rows if r["status"] not in ("ok", "fallback")]
    reasons = Counter(_reason_key(r.get("reason", "")) for r in rows if r.get("reason"))
    worst = max(rows, key=lambda r: r.get("ratio", -1.0), default=None)
    worst_txt = "none"
    if worst is not None and "ratio" in worst:
        worst_txt = (f"{max(worst['err_vs_f64'].values()):.2e} vs tol {worst['tol']:.2e} "
                     f"(x{worst['ratio']:.2f}; {worst['kind']} {worst['directions']}d "
                     f"{worst['layers']}x{worst['units']} B{worst['batch']} T{worst['steps']} "
                     f"{worst['dtype']}, {worst['path']})")
    return (f"sweep: {len(rows)} cases in {seconds:.0f} s, "
            f"{len(rows) - len(fell) - len(bad)} passed on the kernel ("
            + ", ".join(f"{k} {v}" for k, v in sorted(paths.items())) + "), "
            f"{len(fell)} refused and exact on cuDNN, {len(bad)} FAILED; refusals: "
            + ("; ".join(f"{v}x {k}" for k, v in reasons.most_common()) or "none")
            + f"; worst error {worst_txt}")


def cmd_sweep(args):
    """`sweep_case` over `sweep_cases(args.cases, args.seed)`, stopping
    when `args.budget` seconds have passed; exit 1 if any case failed."""
    start = time.perf_counter()
    rows = []
    for i, case in enumerate(sweep_cases(args.cases, args.seed)):
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s reached after {i} cases", flush=True)
            break
        try:
            row = sweep_case(*case, seed=args.seed * 100000 + i)
        except Exception as exc:  # noqa: BLE001 - record and go on
            row = dict(case=list(case), status="ERROR", error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        print(list(case), json.dumps({k: row.get(k) for k in
                                      ("status", "path", "ratio", "reason", "error")}), flush=True)
        _dump(args.out, dict(meta=_meta(), results=rows))
        torch.cuda.empty_cache()
    line = sweep_summary(rows, time.perf_counter() - start)
    print(line, flush=True)
    _dump(args.out, dict(meta=_meta(), summary=line, results=rows))
    return 1 if any(r["status"] not in ("ok", "fallback") for r in rows) else 0


def _print_row(row):
    if "error" in row or "skipped" in row or "cudnn_fused_ms" not in row:
        print(json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
        return
    name = f"{row['kind']} {row['layers']}x{row['units']} B{row['batch']} T{row['steps']} {row['dtype']}"
    k = row.get("kernel_ms")
    print(f"{name:36s} kernel {k if k is None else round(k, 2)} ms "
          f"({row.get('us_per_step', float('nan')):.2f} us/step)  cudnn fused "
          f"{row['cudnn_fused_ms']:.2f}  per-layer {row['cudnn_per_layer_ms']:.2f}  floor "
          f"{row['floor_ms']:.2f}  x{row.get('speedup_vs_best_cudnn', float('nan')):.2f}"
          + ("" if k else f"  [{row.get('kernel')}]"), flush=True)
    for v in row.get("variants", [])[1:]:
        print(f"{'':36s} variant {v}: kernel {row[f'kernel_ms_v{v}']:.2f} ms "
              f"(x{row[f'ratio_kernel_v{v}']:.3f} of variant {row['variants'][0]}), alone "
              f"{row[f'kernel_only_ms_v{v}']:.2f} ms ({row[f'us_per_step_v{v}']:.2f} us/step, "
              f"x{row[f'ratio_kernel_only_v{v}']:.3f})", flush=True)


def _variants(args) -> tuple[int, ...]:
    """bench's variants: --variants (comma-separated) or --variant."""
    if args.variants:
        return tuple(int(v) for v in args.variants.split(","))
    return (args.variant,)


def _meta():
    p = torch.cuda.get_device_properties(0)
    return dict(device=p.name, sms=p.multi_processor_count, torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), library=str(library.load().path),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


def _dump(path, obj):
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--fixed", type=int, default=len(FIXED_CASES))
    c.add_argument("--random", type=int, default=12)
    c.add_argument("--edge", type=int, default=0, help="also the first N of EDGE_CASES")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--variant", type=int, default=0, help="the forward step's variant")
    c.add_argument("--out", default="")
    b = sub.add_parser("bench")
    b.add_argument("--cells", choices=("headline", "matrix"), default="headline")
    b.add_argument("--reps", type=int, default=10)
    b.add_argument("--budget", type=float, default=300.0)
    b.add_argument("--kernel-only", action="store_true", help="leave cuDNN out")
    b.add_argument("--variant", type=int, default=0, help="the forward step's variant")
    b.add_argument("--variants", default="",
                   help="comma-separated variants timed interleaved, e.g. 0,1 (overrides --variant)")
    b.add_argument("--out", default="")
    m = sub.add_parser("modes")
    m.add_argument("--reps", type=int, default=10)
    m.add_argument("--variant", type=int, default=0, help="the forward step's variant")
    m.add_argument("--out", default="")
    t = sub.add_parser("trace")
    t.add_argument("--cells", type=int, default=3)
    t.add_argument("--variant", type=int, default=0, help="the forward step's variant")
    t.add_argument("--out", default="")
    g = sub.add_parser("grad")
    g.add_argument("--fixed", type=int, default=len(GRAD_CASES))
    g.add_argument("--random", type=int, default=4)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--backward", choices=("layer", "stack"), default="layer",
                   help="layer: one backward launch a layer; stack: the reverse wavefront")
    g.add_argument("--variant", type=int, choices=(0, 1, 2), default=0,
                   help="the stack backward's kernel variant (with --backward stack)")
    g.add_argument("--kinds", default="lstm",
                   help="lstm, gru or lstm,gru (a GRU's cases run unless --backward stack)")
    g.add_argument("--out", default="")
    tr = sub.add_parser("train")
    tr.add_argument("--cells", type=int, default=3)
    tr.add_argument("--reps", type=int, default=5)
    tr.add_argument("--backward", choices=("layer", "stack"), default="layer",
                    help="stack: also time the reverse-wavefront backward")
    tr.add_argument("--variant", type=int, choices=(0, 1, 2), default=0,
                    help="the stack backward's kernel variant (with --backward stack)")
    tr.add_argument("--variants", default="",
                    help="e.g. 0,1,2: time these stack-backward variants interleaved")
    tr.add_argument("--kinds", default="lstm", help="lstm, gru or lstm,gru")
    tr.add_argument("--out", default="")
    sg = sub.add_parser("segments", help="stacks larger than the chip, as wavefront segments")
    sg.add_argument("--reps", type=int, default=10)
    sg.add_argument("--train", action="store_true", help="also time a training step")
    sg.add_argument("--out", default="")
    bi = sub.add_parser("bidirectional", help="bidirectional layers, one launch a layer")
    bi.add_argument("--reps", type=int, default=10)
    bi.add_argument("--train", action="store_true",
                    help="also time a training step (a one-layer launch a direction, "
                    "sequential and concurrent)")
    bi.add_argument("--out", default="")
    sw = sub.add_parser("sweep", help="randomized exactness over the brief's ranges")
    sw.add_argument("--cases", type=int, default=200)
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--budget", type=float, default=110.0, help="seconds; stops drawing cases")
    sw.add_argument("--out", default="")
    args = ap.parse_args(argv)
    return {"check": cmd_check, "sweep": cmd_sweep, "bench": cmd_bench, "modes": cmd_modes,
            "trace": cmd_trace, "grad": cmd_grad, "train": cmd_train,
            "segments": cmd_segments, "bidirectional": cmd_bidirectional}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
