"""Why the fused call on rnnfuse's cuDNN core can lose to PyTorch's own cuDNN
calls on small float32 stacks: GPU time against host time, per variant.

For bench_matrix's small shapes (`--shapes`, default lstm2x40 and gru3x64),
one training step (the forward, then the weights' gradients of
sum(y * g)) runs as:

- `vf_per_layer`: one `torch._VF` call a layer, the weights as separate
  tensors (what Keras' torch LSTM/GRU layers run);
- `vf_multi`: one `torch._VF` call over every layer;
- `core`, `core_fma`, `core_small_h`: rnnfuse's torch binding of its cuDNN core
  (`cudnn_core.run`) on the canonical buffer, TF32 as torch allows it /
  off (cuDNN's FMA math) / on cuDNN's persistent small-h algorithm;
- `core_raw`, `core_raw_nolen`, `core_raw_thread`: the core's three C calls
  through ctypes on buffers made once (no torch glue), with the device
  lengths / with NULL for them (as PyTorch calls cuDNN) / with the backward
  calls on another thread (as autograd runs them: the core's one handle a
  device serves both threads, where PyTorch keeps one a thread);
- `keras`, `fused`: Keras' model and `rnnfuse.optimize(model,
  plan=rnnfuse.FUSED)` (the torch backend's `run_stack` on the core).

Per variant: `first_ms` (the first step, synchronised: one-time costs not paid by an
earlier variant),
`events_ms` (CUDA events around `--steps` back-to-back steps, per step:
the GPU's timeline, idle gaps included), `wall_ms` (host time of the same
steps, synchronised at the end), `host_ms` (median host time of one step
started on an idle GPU, not synchronised after: what the host itself
spends, blocking included), `gpu_busy_ms`, `kernels`, `memcpys`, `memsets`
and `api` (torch.profiler over `--profile-steps` steps: the union of device
intervals a step, device operations a step, and the CUDA API calls with the
most host time a step; the one device synchronisation ending the profile
is the diagnosis's own). Core variants add `first_calls_ms`,
`calls_idle_ms` and `calls_ms`: the host ms of each C call in the first
step, and its median with the GPU idle before it / inside back-to-back steps; `max_diff`: the largest difference of y and of the
weights' gradients from `vf_multi`. Busy GPU time near `events_ms` means
the GPU is the limit; `calls_idle_ms` in milliseconds means the host
blocks inside the call itself. `--first-profile` adds `first_profile`:
cProfile's top functions of the first step (a ctypes call's time is its
Python caller's own).

    KERAS_BACKEND=torch python bench/diag_core_small.py --out /tmp/core_small.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from common import out_path  # noqa: E402

SHAPES = {
    "lstm2x40": dict(kind="lstm", layers=2, units=40, batch=128, steps=168, features=8),
    "gru3x64": dict(kind="gru", layers=3, units=64, batch=256, steps=100, features=64),
}
GATES = {"lstm": 4, "gru": 3}
VARIANTS = ("vf_per_layer", "vf_multi", "core", "core_fma", "core_small_h", "core_raw",
            "core_raw_nolen", "core_raw_thread", "keras", "fused")
CORE_CALLS = ("forward", "backward_data", "backward_weights")


def weights(shape: dict, device, seed: int = 0) -> list[torch.Tensor]:
    """PyTorch's weight list (w_ih, w_hh, b_ih, b_hh a layer), leaves with grad.

    >>> [tuple(w.shape) for w in weights(dict(kind="gru", layers=1, units=2, features=3), "cpu")]
    [(6, 3), (6, 2), (6,), (6,)]"""
    gen = torch.Generator().manual_seed(seed)
    rows, out = GATES[shape["kind"]] * shape["units"], []
    for layer in range(shape["layers"]):
        n = shape["features"] if layer == 0 else shape["units"]
        for size in ((rows, n), (rows, shape["units"]), (rows,), (rows,)):
            w = 0.2 * torch.rand(size, generator=gen) - 0.1
            out.append(w.to(device).requires_grad_())
    return out


def vf_step(shape: dict, x, h0, c0, ws, per_layer: bool):
    """(y, gradient function) of `torch._VF` over the stack, batch-first x."""
    kind, layers = shape["kind"], shape["layers"]
    calls = [(i, 1) for i in range(layers)] if per_layer else [(0, layers)]
    y = x
    for first, count in calls:
        rows = slice(first, first + count)
        params = ws[4 * first:4 * (first + count)]
        state = (h0[rows], c0[rows]) if kind == "lstm" else h0[rows]
        y = getattr(torch._VF, kind)(y, state, params, True, count, 0.0, True, False, True)[0]
    return y


def core_step(shape: dict, x, h0, c0, flat, allow_tf32: bool, algorithm: str | None = None):
    """y (batch-first) of rnnfuse's torch binding of the core, on
    `algorithm` (None: the standard one)."""
    from rnnfuse.backends.torch import cudnn_core
    from rnnfuse.plan import Algorithm

    algo = None if algorithm is None else Algorithm.parse(algorithm)
    code = cudnn_core.algorithm_code(algo, torch.float32, allow_tf32)
    y, _, _ = cudnn_core.run(x.transpose(0, 1), shape["kind"], shape["layers"],
                             shape["units"], flat, h0, c0 if shape["kind"] == "lstm" else None,
                             algorithm=code, allow_tf32=allow_tf32, training=True)
    return y.transpose(0, 1)


class RawCore:
    """The core's three C calls on buffers made once; `dev_lengths=False`
    passes NULL for the device lengths; `worker`, an executor whose thread
    runs the backward calls (autograd runs a backward on its own thread)."""

    def __init__(self, shape: dict, x, h0, c0, flat, dev_lengths: bool, worker=None):
        self.worker = worker
        from rnnfuse.backends.cuda import cudnn_core as binding
        from rnnfuse.backends.torch import cudnn_core

        self.lib = binding.load()
        tf32 = bool(torch.backends.cudnn.allow_tf32)
        self.config = binding.RnnConfig.of(
            shape["kind"], shape["layers"], shape["units"], shape["features"],
            algorithm=cudnn_core.algorithm_code(None, torch.float32, tf32), allow_tf32=tf32)
        self.steps, self.batch = shape["steps"], shape["batch"]
        self.stream = torch.cuda.current_stream().cuda_stream
        work, reserve = self.lib.sizes(self.config, self.steps, self.batch, None, self.stream)
        new = lambda n: torch.empty(n, dtype=torch.uint8, device=x.device)  # noqa: E731
        self.workspace, self.reserve = new(work), new(reserve)
        self.x = x.transpose(0, 1).contiguous()
        self.h0, self.c0, self.flat = h0.contiguous(), c0.contiguous(), flat.detach()
        self.y = torch.empty((self.steps, self.batch, shape["units"]), device=x.device)
        self.dy, self.dx = torch.empty_like(self.y), torch.empty_like(self.x)
        self.hy, self.cy = torch.empty_like(self.h0), torch.empty_like(self.c0)
        self.dhx, self.dcx = torch.empty_like(self.h0), torch.empty_like(self.c0)
        self.dparams = torch.empty_like(self.flat)
        full = torch.full((self.batch,), self.steps, dtype=torch.int32, device=x.device)
        self.lengths = full if dev_lengths else None
        self.lstm = shape["kind"] == "lstm"

    def _common(self) -> dict:
        return dict(host_lengths=None, stream=self.stream,
                    dev_lengths=0 if self.lengths is None else self.lengths.data_ptr(),
                    workspace=self.workspace.data_ptr(), workspace_bytes=self.workspace.numel(),
                    reserve=self.reserve.data_ptr(), reserve_bytes=self.reserve.numel())

    def step(self, g):
        """One forward and backward; y batch-first and the canonical gradient."""
        p, common, cx = lambda t: t.data_ptr(), self._common(), self.c0 if self.lstm else None
        self.lib.forward(self.config, True, self.steps, self.batch, x=p(self.x), hx=p(self.h0),
                         cx=p(cx) if self.lstm else 0, params=p(self.flat), y=p(self.y),
                         hy=p(self.hy), cy=p(self.cy) if self.lstm else 0, **common)
        self.dy.copy_(g.transpose(0, 1))
        if self.worker is None:
            self._backward(p, common, cx)
        else:
            self.worker.submit(self._on_worker, p, common, cx).result()
        return self.y.transpose(0, 1), self.dparams

    def _on_worker(self, p, common, cx):
        from rnnfuse.backends.torch.streams import launch_stream

        launch_stream(self.x.device)  # the context current, as on autograd's thread
        self._backward(p, common, cx)

    def _backward(self, p, common, cx):
        self.lib.backward_data(self.config, self.steps, self.batch, y=p(self.y), dy=p(self.dy),
                               dhy=0, dcy=0, hx=p(self.h0), cx=p(cx) if self.lstm else 0,
                               params=p(self.flat), dx=p(self.dx), dhx=p(self.dhx),
                               dcx=p(self.dcx) if self.lstm else 0, **common)
        self.lib.backward_weights(self.config, self.steps, self.batch, x=p(self.x),
                                  hx=p(self.h0), y=p(self.y), dparams=p(self.dparams), **common)


def _raw_step(shape: dict, x, h0, c0, flat, g, dev_lengths: bool, thread: bool = False):
    """A `RawCore`'s step, the core made by the first step (its one-time costs)."""
    made = []

    def step():
        if not made:
            worker = concurrent.futures.ThreadPoolExecutor(1) if thread else None
            made.append(RawCore(shape, x, h0, c0, flat, dev_lengths, worker))
        return made[0].step(g)
    return step


def keras_models(shape: dict):
    """(Keras' model, the same model fused whole on the core)."""
    import keras

    import rnnfuse

    layer = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[shape["kind"]]
    inp = keras.Input((shape["steps"], shape["features"]))
    x = inp
    for _ in range(shape["layers"]):
        x = layer(shape["units"], return_sequences=True)(x)
    model = keras.Model(inp, x)
    return model, rnnfuse.optimize(model, plan=rnnfuse.FUSED)


def make_steps(shape: dict, names, device="cuda") -> dict:
    """name -> (step() -> (y, canonical weight gradient or None), note)."""
    from rnnfuse.backends.torch import cudnn_core

    b, t, f = shape["batch"], shape["steps"], shape["features"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((b, t, f), generator=gen).to(device)
    g = torch.randn((b, t, shape["units"]), generator=gen).to(device)
    h0 = torch.zeros((shape["layers"], b, shape["units"]), device=device)
    c0 = torch.zeros_like(h0)
    ws = weights(shape, device)
    flat = cudnn_core.canonical_params(ws, shape["layers"]).detach().requires_grad_()

    def graded(forward, leaves, canonical):
        def step():
            y = forward()
            grads = torch.autograd.grad((y * g).sum(), leaves)
            return y, canonical(grads)
        return step

    as_flat = lambda grads: cudnn_core.canonical_params(grads, shape["layers"])  # noqa: E731
    steps = {}
    for name in names:
        if name.startswith("vf_"):
            per_layer = name == "vf_per_layer"
            steps[name] = (graded(lambda p=per_layer: vf_step(shape, x, h0, c0, ws, p), ws,
                                  as_flat), None)
        elif name in ("core", "core_fma", "core_small_h"):
            tf32 = name != "core_fma" and bool(torch.backends.cudnn.allow_tf32)
            algo = "persistent_static_small_h" if name == "core_small_h" else None
            steps[name] = (graded(lambda a=tf32, al=algo: core_step(shape, x, h0, c0, flat, a, al),
                                  [flat], lambda grads: grads[0]), None)
        elif name.startswith("core_raw"):
            steps[name] = (_raw_step(shape, x, h0, c0, flat, g, name != "core_raw_nolen",
                                     thread=name == "core_raw_thread"), None)
        elif name in ("keras", "fused"):
            model = keras_models(shape)[name == "fused"]
            variables = [v.value for v in model.trainable_variables]
            steps[name] = (graded(lambda m=model: m(x, training=True), variables,
                                  lambda grads: None), model)
    return steps


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def device_counts(events, steps: int) -> dict:
    """Kernels, copies and memsets a step, and the union of their
    (name, start us, end us) intervals in ms a step.

    >>> device_counts([("k", 0, 10), ("Memcpy DtoD", 5, 12), ("Memset (Device)", 40, 50)], 1)
    {'kernels': 1.0, 'memcpys': 1.0, 'memsets': 1.0, 'gpu_busy_ms': 0.022}"""
    kinds = {"kernels": 0, "memcpys": 0, "memsets": 0}
    for name, _, _ in events:
        kinds["memcpys" if name.startswith("Memcpy")
              else "memsets" if name.startswith("Memset") else "kernels"] += 1
    busy, end = 0.0, None
    for _, s, e in sorted(events, key=lambda ev: ev[1:]):
        if end is None or s > end:
            busy, end = busy + e - s, e
        elif e > end:
            busy, end = busy + e - end, e
    row = {k: v / steps for k, v in kinds.items()}
    row["gpu_busy_ms"] = round(busy / 1e3 / steps, 3)
    return row


def api_summary(calls: dict, steps: int, top: int = 8) -> list:
    """The CUDA API calls with the most host time: name -> (count, total us).

    >>> api_summary({"cudaLaunchKernel": (10, 50.0), "cuCtxSynchronize": (1, 900.0)}, 1)
    [{'name': 'cuCtxSynchronize', 'calls': 1.0, 'ms': 0.9}, {'name': 'cudaLaunchKernel', 'calls': 10.0, 'ms': 0.05}]"""
    ranked = sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(name=k, calls=c / steps, ms=round(us / 1e3 / steps, 3)) for k, (c, us) in ranked]


def profile(step, steps: int) -> dict:
    """torch.profiler over `steps` steps: device counts and the CUDA API calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync()
    device, api = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device.append((e.name, e.time_range.start, e.time_range.end))
        elif e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
            count, total = api.get(e.name, (0, 0.0))
            api[e.name] = (count + 1, total + e.time_range.elapsed_us())
    return dict(device_counts(device, steps), api=api_summary(api, steps))


class CallTimer:
    """Host ms of the core's C calls (`CoreLibrary`'s methods), each call
    after a device synchronisation where `idle`."""

    def __init__(self):
        self.ms = {name: [] for name in CORE_CALLS}
        self.idle = False

    def __enter__(self):
        from rnnfuse.backends.cuda.cudnn_core import CoreLibrary

        self._saved = {name: getattr(CoreLibrary, name) for name in CORE_CALLS}
        for name, original in self._saved.items():
            def timed(lib, *args, _name=name, _original=original, **kwargs):
                if self.idle:
                    _sync()
                start = time.perf_counter()
                try:
                    return _original(lib, *args, **kwargs)
                finally:
                    self.ms[_name].append(1e3 * (time.perf_counter() - start))
            setattr(CoreLibrary, name, timed)
        return self

    def __exit__(self, *exc):
        from rnnfuse.backends.cuda.cudnn_core import CoreLibrary

        for name, original in self._saved.items():
            setattr(CoreLibrary, name, original)

    def take(self) -> dict:
        out = {k: round(statistics.median(v), 3) for k, v in self.ms.items() if v}
        self.ms = {name: [] for name in CORE_CALLS}
        return out


def first_profile(step, top: int = 12) -> list:
    """cProfile's functions with the most own time in one call of `step`."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    _sync()
    prof.disable()
    rows = [dict(fn=f"{os.path.basename(path)}:{line}({fn})", own_ms=_ms(own), cum_ms=_ms(cum),
                 calls=calls)
            for (path, line, fn), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def measure(step, steps: int, repeats: int, profile_steps: int, core: bool,
            profile_first: bool = False) -> dict:
    """One variant's timings (the module docstring's fields)."""
    row = {}
    with CallTimer() as calls:
        _sync()
        start = time.perf_counter()
        if profile_first:
            row["first_profile"] = first_profile(step)
        else:
            step()
        _sync()
        row["first_ms"] = _ms(time.perf_counter() - start)
        first_calls = calls.take()
        for _ in range(3):
            step()
        calls.take()
        host = []
        calls.idle = True
        for _ in range(repeats):
            _sync()
            start = time.perf_counter()
            step()
            host.append(time.perf_counter() - start)
        _sync()
        idle_calls = calls.take()
        calls.idle = False
        _sync()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        end.record()
        _sync()
        row["wall_ms"] = _ms((time.perf_counter() - start) / steps)
        row["events_ms"] = round(begin.elapsed_time(end) / steps, 3)
        busy_calls = calls.take()
    row["host_ms"] = _ms(statistics.median(host))
    if core:
        row["first_calls_ms"], row["calls_idle_ms"], row["calls_ms"] = (
            first_calls, idle_calls, busy_calls)
    try:
        row.update(profile(step, profile_steps))
    except Exception as err:  # noqa: BLE001 - a profiler that cannot run here: record it
        row["profile_error"] = f"{type(err).__name__}: {err}"
    return row


def max_diff(reference, result) -> dict:
    """The largest |difference| of y and of the canonical weight gradient."""
    (y0, g0), (y1, g1) = reference, result
    row = {"y": float((y0 - y1).detach().abs().max())}
    if g0 is not None and g1 is not None:
        row["weight_grad"] = float((g0 - g1).detach().abs().max())
    return row


def line(shape: str, name: str, row: dict) -> str:
    keys = ("events_ms", "gpu_busy_ms", "wall_ms", "host_ms", "first_ms", "kernels", "memcpys",
            "memsets", "first_calls_ms", "calls_idle_ms", "calls_ms", "max_diff", "ran", "error")
    api = " ".join(f"{c['name']}x{c['calls']:g}={c['ms']}" for c in row.get("api", [])[:4])
    fields = ", ".join(f"{k} {row[k]}" for k in keys if k in row)
    return f"{shape} {name}: {fields}" + (f", api ms {api}" if api else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--first-profile", action="store_true",
                        help="cProfile each variant's first step (its top functions)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_core_small needs a CUDA device (the cuDNN core and cuDNN itself)")
        return 2
    out = args.out or out_path("diag_core_small.json")
    start = time.perf_counter()
    from rnnfuse.backends.cuda import cudnn_core as binding

    binding.load()  # built (or found) before any variant's first step
    print(f"the cuDNN core loaded in {time.perf_counter() - start:.1f} s", flush=True)
    report = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                  cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
                  allow_tf32=bool(torch.backends.cudnn.allow_tf32),
                  rnn_fp32_precision=str(getattr(getattr(torch.backends.cudnn, "rnn", None),
                                                 "fp32_precision", None)),
                  args=vars(args), results=[])
    print(f"cudnn.allow_tf32 {report['allow_tf32']}, cudnn.rnn.fp32_precision "
          f"{report['rnn_fp32_precision']}", flush=True)
    names = [n for n in args.variants.split(",") if n]
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        steps = make_steps(shape, names)
        reference = steps["vf_multi"][0]() if "vf_multi" in steps else None
        for name, (step, model) in steps.items():
            row = dict(shape=shape_name, variant=name)
            try:
                row.update(measure(step, args.steps, args.repeats, args.profile_steps,
                                   core=name.startswith("core") or name == "fused",
                                   profile_first=args.first_profile))
                if reference is not None and name.startswith("core"):
                    row["max_diff"] = max_diff(reference, step())
                if model is not None and name == "fused":
                    from rnnfuse.fused import fused_layers

                    kernel = fused_layers(model)[0].last_path.kernel
                    row["ran"] = f"{kernel.name} {kernel.algorithm} {kernel.note or ''}".strip()
            except Exception as err:  # noqa: BLE001 - one variant failing keeps the others
                row["error"] = f"{type(err).__name__}: {err}"[:400]
            report["results"].append(row)
            print(line(shape_name, name, row), flush=True)
            for top in row.get("first_profile", [])[:6]:
                print(f"{shape_name} {name} first step: {top}", flush=True)
            with open(out, "w") as fh:
                json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
