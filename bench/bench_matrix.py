"""The backend matrix: named shapes, every backend, and a plain PyTorch loop.

One process measures one backend (KERAS_BACKEND, or `--backend pytorch` for
the peer), so every backend runs the same script on the same machine, one
after the other. Per shape, for Keras' own model ("original") and
`rnnfuse.optimize(model)` ("optimized", its defaults, an empty plan cache):

- `first_call_s`: the whole first `fit(epochs=--epochs)` call of each model,
  `--epoch-steps` batches an epoch, from a fresh model (traces, tuning);
  the optimized model goes first, so it also pays the process's one-time
  library loading;
- `fit_ms`: `fit` step medians, the two models in interleaved rounds
  (bench_user_view's step timer: the gap between two batch ends);
- `train_on_batch_ms`, `test_on_batch_ms`, `predict_on_batch_ms`,
  `predict_ms`, `evaluate_ms`: medians of interleaved calls (`predict` and
  `evaluate` steps timed as `fit`'s);
- `loop_ms`: a custom training loop's step median (a `tf.function`
  GradientTape step on TensorFlow, forward, `backward()` and a torch
  optimizer step on torch; bench_user_view.custom_loop; none on JAX);
- `plans`: what each fused layer of the optimized model chose;
- `original_failed`: Keras' own error where its model fails in the shape's
  policy (its LSTM in mixed_float16 on JAX); the original is then the
  model in float32 (Keras' model is built apart from the one optimized);
- `tuning_share`: the tuner's seconds (every candidate's first call
  included: on JAX its step's compile) against the first fit's, as its
  user waits: first-batch tuning runs inside that fit; `--tuned` tuning
  runs in `optimize`, before it, so the wait is both. With `--epochs 10`
  it is tuning's share of a 10-epoch fit; `--shares` compares backends.

The peer (`--backend pytorch`) trains the same model written as a PyTorch
user would: `nn.LSTM`/`nn.GRU`/`nn.RNN` with `num_layers`, `bidirectional`
and `proj_size`, `pack_padded_sequence` for a masked input, autocast and a
GradScaler where the Keras policy is mixed, Adam, a Linear head on the last
step; `fit_ms` is its step median.

    KERAS_BACKEND=tensorflow python bench/bench_matrix.py --out /tmp/m_tf.json
    KERAS_BACKEND=torch python bench/bench_matrix.py --out /tmp/m_torch.json
    python bench/bench_matrix.py --backend pytorch --out /tmp/m_pt.json
    python bench/bench_matrix.py --table /tmp/m_tf.json /tmp/m_torch.json /tmp/m_pt.json
    python bench/bench_matrix.py --quick --out /tmp/q.json   # tiny shapes, any machine
    KERAS_BACKEND=torch python bench/bench_matrix.py --tuned ...  # every candidate timed first
    python bench/bench_matrix.py --shares /tmp/m_jax.json /tmp/m_tf.json  # tuning's shares
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import out_path, share_table, tuning_share  # noqa: E402

# The named shapes: the large matrix first, then the small float32 models.
SHAPES = {
    "lstm4x512": dict(kind="lstm", layers=4, units=512, batch=64, steps=1000, dtype="mixed_float16", features=512),
    "bigru5x512": dict(kind="bi_gru", layers=5, units=512, batch=32, steps=500, dtype="mixed_float16", features=512),
    "bilstm4x384": dict(kind="bi_lstm", layers=4, units=384, batch=24, steps=700, dtype="mixed_float16", features=80),
    "lstm3x768": dict(kind="lstm", layers=3, units=768, batch=16, steps=1200, dtype="mixed_float16", features=80),
    "gru3x192": dict(kind="gru", layers=3, units=192, batch=64, steps=300, dtype="float32", features=192),
    "plstm4x1024": dict(kind="plstm", layers=4, units=1024, proj=256, batch=32, steps=500,
                        dtype="mixed_float16", features=256),
    "masked_lstm2x256": dict(kind="lstm", layers=2, units=256, batch=64, steps=100, dtype="float32", masked=True),
    "gru3x64": dict(kind="gru", layers=3, units=64, batch=256, steps=100, dtype="float32", features=64),
    "rnn3x256": dict(kind="simple_rnn", layers=3, units=256, batch=64, steps=200, dtype="float32", features=256),
    "lstm8x128": dict(kind="lstm", layers=8, units=128, batch=512, steps=20, dtype="float32", features=128),
    "lstm2x40": dict(kind="lstm", layers=2, units=40, batch=128, steps=168, dtype="float32", features=8),
}
VOCAB = 1000
HEAD = 8
# The clock of the first fits, `optimize` and the tuner's stopwatch (tests
# replace it with a fake one).
clock = time.perf_counter


def quick(shape: dict) -> dict:
    """A tiny version of `shape` that runs anywhere in seconds.

    >>> quick(SHAPES["lstm4x512"])["units"], quick(SHAPES["plstm4x1024"])["proj"]
    (16, 8)
    """
    small = dict(shape, layers=min(shape["layers"], 2), units=16, batch=4, steps=6,
                 features=min(shape.get("features", 8), 8))
    if "proj" in small:
        small["proj"] = 8
    return small


def data(shape: dict, seed: int = 0) -> tuple:
    """(x, y, lengths): inputs (token ids, right-padded with 0, where masked),
    targets for the Dense head, and each sequence's length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    b, t = shape["batch"], shape["steps"]
    lengths = np.full(b, t)
    if shape.get("masked"):
        x = rng.integers(1, VOCAB, size=(b, t)).astype("int32")
        lengths = rng.integers(max(1, t // 2), t + 1, size=b)
        for i, n in enumerate(lengths):
            x[i, n:] = 0
    else:
        x = rng.standard_normal((b, t, shape["features"])).astype("float32")
    return x, rng.standard_normal((b, HEAD)).astype("float32"), lengths


# -- Keras, on the process's backend -------------------------------------------


def build_keras(shape: dict):
    """The Keras model of `shape`: [Embedding(mask_zero)] -> layers -> Dense."""
    import keras

    from rnnfuse.layers import ProjectedLSTM

    keras.config.set_dtype_policy(shape["dtype"])
    try:
        if shape.get("masked"):
            inp = keras.Input((shape["steps"],), dtype="int32")
            x = keras.layers.Embedding(VOCAB, 64, mask_zero=True)(inp)
        else:
            inp = keras.Input((shape["steps"], shape["features"]))
            x = inp
        kind = shape["kind"]
        for i in range(shape["layers"]):
            seq = i < shape["layers"] - 1
            if kind == "plstm":
                layer = ProjectedLSTM(shape["units"], shape["proj"], return_sequences=seq)
            else:
                make = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU,
                        "simple_rnn": keras.layers.SimpleRNN}[kind.removeprefix("bi_")]
                layer = make(shape["units"], return_sequences=seq)
                if kind.startswith("bi_"):
                    layer = keras.layers.Bidirectional(layer)
            x = layer(x)
        return keras.Model(inp, keras.layers.Dense(HEAD, dtype="float32")(x))
    finally:
        keras.config.set_dtype_policy("float32")


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def _interleaved_calls(pair, call, rounds: int) -> dict:
    """{name: [seconds]} of `call(model)` for each model, alternating, the
    order flipped every round, each call waited for (host values)."""
    seconds = {name: [] for name, _ in pair}
    for r in range(rounds):
        for name, m in pair if r % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            call(m)
            seconds[name].append(time.perf_counter() - start)
    return seconds


class _Stopwatch:
    """Wraps `owner.name` while on, adds up the seconds spent in it (the
    tuner's `choose_plans` inside `optimize`) and keeps what it returned."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.seconds, self.returned = owner, name, 0.0, []

    def __enter__(self):
        real = self.real = getattr(self.owner, self.name)

        def timed(*args, **kwargs):
            start = clock()
            try:
                result = real(*args, **kwargs)
                self.returned.append(result)
                return result
            finally:
                self.seconds += clock() - start

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.real)


def tuned_decisions(returned: list) -> list[dict]:
    """`optimize(tune=...)`'s choices and per-candidate step medians in ms,
    from the `TuneResult` lists `choose_plans` returned.

    >>> from types import SimpleNamespace as R
    >>> tuned_decisions([[R(plan=R(name="fused"), source="measured", timings={"fused": 0.002})]])
    [{'mode': 'tuned', 'chosen': 'fused', 'source': 'measured', 'timings_ms': {'fused': 2.0}}]
    """
    return [dict(mode="tuned", chosen=r.plan.name, source=r.source,
                 timings_ms={k: 1e3 * v for k, v in r.timings.items()})
            for results in returned for r in results]


def share_line(backend: str, name: str, share: dict) -> str:
    """The printed line of a shape's tuning share.

    >>> share_line("jax", "gru3x64", dict(tuning_s=1.5, fit_s=30.0, share=0.05, epochs=10))
    'share jax gru3x64: tuning 1.50 s of a 10-epoch fit of 30.00 s = 5.0%'
    """
    pct = "-" if share["share"] is None else f"{100 * share['share']:.1f}%"
    return (f"share {backend} {name}: tuning {share['tuning_s']:.2f} s of a {share['epochs']}-epoch "
            f"fit of {share['fit_s']:.2f} s = {pct}")


def shares_of(files: list[str]) -> list[tuple[str, dict]]:
    """[(backend, {shape: tuning share})] of result files, for `share_table`."""
    runs = []
    for path in files:
        with open(path) as f:
            run = json.load(f)
        shares = {r["shape_name"]: r["tuning_share"]["share"] for r in run["results"]
                  if "tuning_share" in r}
        runs.append((run["meta"]["backend"], shares))
    return runs


def measure_keras(shape: dict, epochs: int, epoch_steps: int, rounds: int, steps: int,
                  tuned: bool = False) -> dict:
    import importlib

    import keras
    import numpy as np

    import rnnfuse
    from bench_user_view import _alternate, _tuning_seconds, custom_loop

    from rnnfuse.fused import fused_layers
    from rnnfuse.tuning.first_batch import decisions

    model = build_keras(shape)
    x, y, _ = data(shape)
    # --tuned: the plan a long fit commits to (every candidate timed on the
    # batch now), instead of what a short first fit's budget allows.
    start = clock()
    with _Stopwatch(importlib.import_module("rnnfuse.api"), "choose_plans") as tuner:
        fast = rnnfuse.optimize(model, cache=False, tune=x if tuned else "auto")
    optimize_s = clock() - start
    # Built apart from the model optimized, whose variables the optimized
    # model shares: a fit that fails leaves its model's variables unusable.
    original = build_keras(shape)
    original.compile(optimizer="adam", loss="mse")
    fast.compile(optimizer="adam", loss="mse")
    b = shape["batch"]
    xe, ye = np.concatenate([x] * epoch_steps), np.concatenate([y] * epoch_steps)
    first = {}
    start = clock()
    fast.fit(xe, ye, batch_size=b, epochs=epochs, verbose=0)
    first["optimized"] = clock() - start
    first_fit_tuning_s = _tuning_seconds(fast)  # later calls may tune more
    original_failed = None
    start = clock()
    try:
        original.fit(xe, ye, batch_size=b, epochs=epochs, verbose=0)
    except Exception as err:  # noqa: BLE001 - Keras' own failure in this policy, recorded
        # The baseline is what its user can run instead: the model in float32.
        original_failed = f"{type(err).__name__}: {err}"
        print(f"original fails in {shape['dtype']} ({original_failed}); its float32 twin "
              "is the baseline", flush=True)
        original = build_keras(dict(shape, dtype="float32"))
        original.compile(optimizer="adam", loss="mse")
        start = clock()
        original.fit(xe, ye, batch_size=b, epochs=epochs, verbose=0)
    first["original"] = clock() - start
    pair = [("original", original), ("optimized", fast)]
    xs, ys = np.concatenate([x] * max(3, steps)), np.concatenate([y] * max(3, steps))
    fit = _alternate(pair, rounds, lambda m, cb: m.fit(xs, ys, batch_size=b, epochs=1, verbose=0,
                                                       callbacks=[cb]))
    tob = _interleaved_calls(pair, lambda m: float(np.asarray(m.train_on_batch(x, y))), 3 * rounds)
    pob = _interleaved_calls(pair, lambda m: np.asarray(m.predict_on_batch(x)), 3 * rounds)
    pred = _alternate(pair, rounds, lambda m, cb: m.predict(xs, batch_size=b, verbose=0, callbacks=[cb]))
    tst = _interleaved_calls(pair, lambda m: float(np.asarray(m.test_on_batch(x, y))), 3 * rounds)
    ev = _alternate(pair, rounds, lambda m, cb: m.evaluate(xs, ys, batch_size=b, verbose=0, callbacks=[cb]))
    loop = custom_loop(pair, x, y, steps=max(3, steps) * rounds, block=max(3, steps))
    row = dict(
        original_failed=original_failed,
        first_call_s=first,
        optimize_s=optimize_s,
        fit_ms={k: _median_ms(v) for k, v in fit.items()},
        train_on_batch_ms={k: _median_ms(v[1:]) for k, v in tob.items()},
        predict_on_batch_ms={k: _median_ms(v[1:]) for k, v in pob.items()},
        predict_ms={k: _median_ms(v) for k, v in pred.items()},
        test_on_batch_ms={k: _median_ms(v[1:]) for k, v in tst.items()},
        evaluate_ms={k: _median_ms(v) for k, v in ev.items()},
        loop_ms=None if loop is None else {k: _median_ms(v[1:]) for k, v in loop.items()},
        loop_first_s=None if loop is None else {k: v[0] for k, v in loop.items()},
        tuning_s=_tuning_seconds(fast),
        plans=[dict(layers=[l.name for l in f.fused_layers], plan=f.plan.name, kernel=f.plan.kernel)
               for f in fused_layers(fast)],
        decisions=[dict(mode=d.get("mode"), chosen=d.get("chosen"), timings_ms=d.get("timings_ms"))
                   for d in decisions(fast)] + tuned_decisions(tuner.returned),
        raw=dict(fit=fit),
    )
    row["fit_speedup"] = row["fit_ms"]["original"] / row["fit_ms"]["optimized"]
    row["tuning_share"] = dict(
        tuning_share(tuner.seconds if tuned else first_fit_tuning_s, first["optimized"], tuned),
        epochs=epochs, epoch_steps=epoch_steps, where="optimize" if tuned else "first batch")
    keras.backend.clear_session()
    return row


# -- the plain PyTorch loop ----------------------------------------------------


def build_torch(shape: dict):
    """The peer model: what a PyTorch user writes for `shape`."""
    import torch
    from torch import nn

    kind = shape["kind"]
    bi = kind.startswith("bi_")
    base = kind.removeprefix("bi_")

    class Peer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 64, padding_idx=0) if shape.get("masked") else None
            features = 64 if self.embed is not None else shape["features"]
            kwargs = dict(num_layers=shape["layers"], bidirectional=bi, batch_first=True)
            if base in ("lstm", "plstm"):
                self.rnn = nn.LSTM(features, shape["units"], proj_size=shape.get("proj", 0), **kwargs)
            elif base == "gru":
                self.rnn = nn.GRU(features, shape["units"], **kwargs)
            else:
                self.rnn = nn.RNN(features, shape["units"], nonlinearity="tanh", **kwargs)
            width = (shape.get("proj") or shape["units"]) * (2 if bi else 1)
            self.head = nn.Linear(width, HEAD)

        def forward(self, x, lengths):
            if self.embed is not None:
                x = self.embed(x)
                packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                                           enforce_sorted=False)
                out, _ = self.rnn(packed)
                out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
                last = out[torch.arange(out.shape[0]), lengths.to(out.device) - 1]
            else:
                out, _ = self.rnn(x)
                last = out[:, -1]
            return self.head(last)

    return Peer()


def measure_pytorch(shape: dict, epochs: int, epoch_steps: int, rounds: int, steps: int) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Autocast on the GPU only: oneDNN's CPU LSTM refuses float16.
    amp = {"mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16}.get(shape["dtype"])
    amp = amp if device == "cuda" else None
    model = build_torch(shape).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, enabled=amp is torch.float16)
    x, y, lengths = (torch.as_tensor(a).to(device) for a in data(shape))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=amp or torch.float32, enabled=amp is not None):
            loss = torch.mean((model(x, lengths).float() - y) ** 2)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    start = time.perf_counter()
    for _ in range(epochs * epoch_steps):
        loss = step()
    loss.item()
    first = time.perf_counter() - start
    seconds = []
    for _ in range(rounds * max(3, steps)):
        start = time.perf_counter()
        step().item()  # waits for the device, as Keras' progress bar does
        seconds.append(time.perf_counter() - start)
    return dict(first_call_s=dict(pytorch=first), fit_ms=dict(pytorch=_median_ms(seconds)))


# -- the table -----------------------------------------------------------------


def table(files: list[str]) -> str:
    """A Markdown table of `fit` step medians (ms) from result files, one
    column per backend and model, the optimized model's speedup beside it."""
    runs = [json.load(open(f)) for f in files]
    names = list(dict.fromkeys(r["shape_name"] for run in runs for r in run["results"]))
    cols, cells = [], {}
    for run in runs:
        backend = run["meta"]["backend"]
        for r in run["results"]:
            for model, ms in r.get("fit_ms", {}).items():
                col = backend if model == "pytorch" else f"{model} {backend}"
                cols.append(col)
                speed = f" ({r['fit_speedup']:.2f}x)" if model == "optimized" else ""
                cells[r["shape_name"], col] = f"{ms:.1f}{speed}"
            if "error" in r:
                cols.append(f"error {backend}")
                cells[r["shape_name"], f"error {backend}"] = r["error"][:60]
    cols = list(dict.fromkeys(cols))
    lines = ["| shape | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(cells.get((n, c), "-") for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="JSON file, rewritten after each shape (default: outside the repository)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--backend", choices=("keras", "pytorch"), default="keras",
                        help="keras: KERAS_BACKEND's Keras; pytorch: the plain PyTorch loop")
    parser.add_argument("--epochs", type=int, default=1, help="epochs of the timed first fit call")
    parser.add_argument("--epoch-steps", type=int, default=10, help="batches an epoch")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--steps", type=int, default=5, help="steps a timed round")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--tuned", action="store_true",
                        help="optimize(model, tune=batch): time every candidate first (a long fit's plan)")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these results")
    parser.add_argument("--shares", nargs="+", metavar="JSON",
                        help="print the tuning shares of these results (two: the first over the second)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.shares:
        print(share_table(shares_of(args.shares)))
        return 0
    if not args.out:
        parser.error("--out is required unless --table or --shares is given")
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    if args.backend == "pytorch":
        import torch

        backend, measure = "pytorch", measure_pytorch
        meta = dict(backend=backend, torch=torch.__version__,
                    device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    else:
        import keras

        import rnnfuse

        backend = keras.backend.backend()
        measure = functools.partial(measure_keras, tuned=args.tuned)
        meta = dict(backend=backend, keras=keras.__version__, rnnfuse=rnnfuse.__version__,
                    step_stamps="async")
    meta.update(python=platform.python_version(), epochs=args.epochs, epoch_steps=args.epoch_steps,
                rounds=args.rounds, steps=args.steps, quick=args.quick,
                tuned=args.tuned)
    args.out = args.out or out_path(f"matrix_{backend}.json")
    results = []
    for name in args.shapes.split(","):
        shape = quick(SHAPES[name]) if args.quick else SHAPES[name]
        try:
            row = dict(shape_name=name, shape=shape,
                       **measure(shape, args.epochs, args.epoch_steps, args.rounds, args.steps))
            print(f"{backend} {name} fit_ms {row['fit_ms']} first {row['first_call_s']}"
                  f"{' plans ' + str(row['plans']) if 'plans' in row else ''}", flush=True)
            if "tuning_share" in row:
                print(share_line(backend, name, row["tuning_share"]), flush=True)
        except Exception as err:  # noqa: BLE001 - record and go on
            row = dict(shape_name=name, shape=shape, error=f"{type(err).__name__}: {err}")
            print("ERROR", backend, name, row["error"], flush=True)
        results.append(row)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
