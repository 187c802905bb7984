"""The `rnnfuse` command line: each command's output and exit codes.

Most tests call `rnnfuse.cli.main(argv)` in this process (TensorFlow loads
once); one test runs `python -m rnnfuse` as subprocesses (stderr there also
holds TensorFlow's own C++ start-up log lines, which the test sets aside),
one of them under the torch backend. Every error case must exit 2 with exactly one line on stderr
and no traceback.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest

import rnnfuse
from rnnfuse import cli

# A small module of model-building functions, loaded as module:function.
MODELS = '''
import keras

def stack():
    """Two LSTMs that fuse, then one of another width: a group of one."""
    inp = keras.Input((8, 3), name="x")
    x = keras.layers.LSTM(4, return_sequences=True, name="lstm_a")(inp)
    x = keras.layers.LSTM(4, return_sequences=True, name="lstm_b")(x)
    x = keras.layers.LSTM(6, name="lstm_wide")(x)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(x), name="stack")

def fusable():
    return keras.Sequential([
        keras.Input((6, 3), name="x"),
        keras.layers.LSTM(4, return_sequences=True, name="lstm_a"),
        keras.layers.LSTM(4, name="lstm_b"),
        keras.layers.Dense(2, name="head"),
    ], name="fusable")

def text():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(7, 3, mask_zero=True, name="embed")(tokens)
    x = keras.layers.GRU(4, return_sequences=True, name="gru_a")(x)
    x = keras.layers.GRU(4, name="gru_b")(x)
    return keras.Model(tokens, x, name="text")

def open_features():
    inp = keras.Input((5, None), name="x")
    return keras.Model(inp, keras.layers.Activation("tanh")(inp))

class Sub(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.LSTM(4, return_sequences=True)
        self.b = keras.layers.LSTM(4)
    def call(self, x):
        return self.b(self.a(x))

def subclassed():
    model = Sub()
    model(keras.ops.zeros((1, 5, 3)))
    return model

def odd_names():
    """Layer names that read as rich markup."""
    return keras.Sequential([
        keras.Input((6, 3), name="x"),
        keras.layers.LSTM(4, return_sequences=True, name="enc[bold]"),
        keras.layers.LSTM(4, return_sequences=True, name="enc[italic]"),
        keras.layers.GRU(5, name="odd[red]"),
    ], name="odd")

def split_by_dropout():
    """Dropout after the first LSTM only: two groups, kept apart by it."""
    inp = keras.Input((6, 3), name="x")
    x = keras.layers.LSTM(4, return_sequences=True, name="lstm_a")(inp)
    x = keras.layers.Dropout(0.1, name="drop")(x)
    x = keras.layers.LSTM(4, return_sequences=True, name="lstm_b")(x)
    x = keras.layers.LSTM(4, return_sequences=True, name="lstm_c")(x)
    return keras.Model(inp, keras.layers.LSTM(4, name="lstm_d")(x), name="split_by_dropout")

def dense():
    return keras.Sequential([keras.Input((6, 3), name="x"), keras.layers.Dense(2, name="head")],
                            name="dense")

def not_a_model():
    return [1, 2]

def unbuilt():
    return keras.Sequential([keras.layers.LSTM(4)])

def boom():
    return 1 / 0

def needs_arg(units):
    return None
'''

CUSTOM = '''
import keras

@keras.saving.register_keras_serializable(package="rnnfuse_cli_test")
class Scale(keras.layers.Layer):
    def call(self, x):
        return 2.0 * x
'''

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with models.py, custom_layers.py and saved model files."""
    path = tmp_path_factory.mktemp("cli")
    (path / "models.py").write_text(MODELS)
    (path / "custom_layers.py").write_text(CUSTOM)
    sys.path.insert(0, str(path))
    import models

    models.stack().save(path / "stack.keras")
    models.fusable().save(path / "fusable.keras")

    import custom_layers

    custom = keras.Sequential(
        [keras.Input((4, 3)), keras.layers.LSTM(4, return_sequences=True, name="lstm_c"), custom_layers.Scale()]
    )
    custom.save(path / "custom.keras")
    lam = keras.Sequential([keras.Input((4, 3)), keras.layers.Lambda(lambda x: x * 2)])
    lam.save(path / "lambda.keras")
    _unregister_custom_layers()
    sys.path.remove(str(path))
    for name in ("models", "custom_layers"):
        sys.modules.pop(name, None)
    return path


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    yield workdir
    for name in ("models", "custom_layers"):
        sys.modules.pop(name, None)
    _unregister_custom_layers()


def _unregister_custom_layers():
    objects = keras.saving.get_custom_objects()
    for name in [n for n in objects if n.startswith("rnnfuse_cli_test>")]:
        del objects[name]


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- inspect -------------------------------------------------------------------


def test_inspect_prints_groups_and_reasons(in_workdir, capsys):
    code, out, err = _run(capsys, "inspect", "stack.keras")
    assert code == 0, err
    model = keras.saving.load_model(in_workdir / "stack.keras")
    report = rnnfuse.analyze(model)
    for group in report.groups:
        assert " -> ".join(group.layers) in out
    for name, reason in report.skipped.items():
        assert name in out and reason.rule in out
    assert f"{len(report.groups)} group(s) of" in out


def test_inspect_json_is_the_report(in_workdir, capsys):
    code, out, err = _run(capsys, "inspect", "models.py:stack", "--json")
    assert code == 0, err
    data = json.loads(out)
    import models

    report = json.loads(json.dumps(rnnfuse.analyze(models.stack()).to_dict()))
    assert data["schema_version"] == 1 and data["command"] == "inspect"
    assert data["skipped"] == report["skipped"] and data["breaks"] == report["breaks"]
    assert set(report["notes"]) <= set(data["notes"])
    for group, expected in zip(data["groups"], report["groups"], strict=True):
        assert {k: group[k] for k in expected} == expected
        assert group["plan"]["source"] == "static"
        assert group["runs"]["fused"] is False
    assert [g["layers"] for g in data["groups"]] == [["lstm_a", "lstm_b"], ["lstm_wide"]]
    # No GPU in CI: the fused layer would run the original layers.
    assert "GPU" in data["groups"][0]["runs"]["why"]
    # The group of one: TensorFlow's static plan keeps Keras' layer.
    assert data["groups"][1]["plan"]["name"] == "per-layer"
    assert "static plan" in data["groups"][1]["runs"]["why"]
    code, out, err = _run(capsys, "inspect", "models.py:stack", "--json", "--min-layers", "2")
    assert code == 0, err
    assert json.loads(out)["skipped"]["lstm_wide"]["rule"] == "units"


def test_inspect_module_function_and_min_layers(in_workdir, capsys):
    code, out, err = _run(capsys, "inspect", "models:fusable", "--min-layers", "3", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["groups"] == []
    assert {v["rule"] for v in data["skipped"].values()} == {"min_layers"}


def test_inspect_plot_writes_an_image(in_workdir, capsys, tmp_path):
    target = tmp_path / "graph.png"
    code, out, err = _run(capsys, "inspect", "stack.keras", "--plot", target)
    assert code == 0, err
    data = target.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG")
    assert str(target) in out


def _two_towers():
    """Two inputs, two fusable towers, and a skip connection past one tower."""
    a = keras.Input((6, 3), name="query")
    b = keras.Input((7, 3), name="document")
    x = keras.layers.LSTM(4, return_sequences=True, name="q1")(a)
    x = keras.layers.LSTM(4, name="q2")(x)
    y = keras.layers.GRU(4, return_sequences=True, name="d1")(b)
    y = keras.layers.GRU(4, name="d2")(y)
    z = keras.layers.Concatenate(name="join")([x, y])
    skip = keras.layers.GlobalAveragePooling1D(name="pool")(a)
    z = keras.layers.Concatenate(name="with_skip")([z, skip])
    return keras.Model([a, b], keras.layers.Dense(1, name="score")(z))


def test_plot_boxes_use_names_shapes_and_verdicts():
    from rnnfuse.passes import build_layer_graph
    from rnnfuse.plotting import _picture

    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(9, 3, mask_zero=True, name="embed")(tokens)
    x = keras.layers.GRU(4, return_sequences=True, name="g1")(x)
    x = keras.layers.GRU(4, return_sequences=True, name="g2")(x)
    x = keras.layers.SimpleRNN(4, activation="sigmoid", name="odd")(x)
    model = keras.Model(tokens, x)
    report = rnnfuse.analyze(model)
    picture = _picture(model, build_layer_graph(model), report, None)
    assert picture.boxes["g1"].kind == picture.boxes["g2"].kind == "fused"
    assert picture.boxes["odd"].kind == "skipped"
    assert f"not fused: {report.skipped['odd'].rule}" in picture.boxes["odd"].lines
    assert "(None, None, 4) -> (None, None, 4)" in picture.boxes["g2"].lines
    assert "mask from embed" in picture.boxes["g1"].lines
    # User-facing names only: no auto-generated tensor names, no mask ops.
    text = " ".join(b.label for b in picture.boxes.values())
    assert "keras_tensor" not in text and "NotEqual" not in text and "not_equal" not in text


@pytest.mark.parametrize("functional", [False, True])
def test_plot_draws_a_masking_layers_mask_and_no_mask_ops(functional):
    """A Functional model once drew a stray `not_equal` box (Masking's
    NotEqual -> Any chain) and a Sequential one drew no mask at all."""
    from rnnfuse.passes import build_layer_graph
    from rnnfuse.plotting import _picture

    layers = [
        keras.layers.Masking(name="pad"),
        keras.layers.LSTM(4, return_sequences=True, name="l1"),
        keras.layers.Dense(4, name="mid"),
        keras.layers.LSTM(4, name="l2"),
    ]
    if functional:
        x = inp = keras.Input((6, 3), name="x")
        for layer in layers:
            x = layer(x)
        model = keras.Model(inp, x)
    else:
        model = keras.Sequential([keras.Input((6, 3)), *layers])
    picture = _picture(model, build_layer_graph(model), rnnfuse.analyze(model), None)
    assert sorted(picture.boxes) == sorted([next(iter(picture.boxes)), "pad", "l1", "mid", "l2"])
    assert "mask from pad" in picture.boxes["l1"].lines
    assert "mask from pad" in picture.boxes["l2"].lines  # Dense passes it on
    assert not any(line.startswith("mask") for line in picture.boxes["mid"].lines)
    assert ("pad", "l1") in picture.arrows


@pytest.mark.parametrize("engine", ["matplotlib", "graphviz"])
def test_plot_of_two_towers_keeps_arrows_off_other_boxes(engine, tmp_path):
    from rnnfuse.plotting import _has_graphviz, _layout, _picture, plot_layer_graph
    from rnnfuse.passes import build_layer_graph

    if engine == "graphviz" and not _has_graphviz():
        pytest.skip("pydot or Graphviz's dot is not installed")
    model = _two_towers()
    plot_layer_graph(model, tmp_path / "towers.png", engine=engine)
    assert (tmp_path / "towers.png").read_bytes().startswith(b"\x89PNG")
    if engine == "graphviz":
        return  # dot routes its own edges around nodes
    picture = _picture(model, build_layer_graph(model), rnnfuse.analyze(model), None)
    layout = _layout(picture)

    def inside(point, key, margin=1e-6):
        (x, y), (w, h) = layout.centre[key], layout.size[key]
        return abs(point[0] - x) < w / 2 - margin and abs(point[1] - y) < h / 2 - margin

    for (src, dst), route in zip(picture.arrows, layout.routes):
        # Sample every segment; no point may fall inside an unrelated box.
        for (x0, y0), (x1, y1) in zip(route, route[1:]):
            for t in np.linspace(0, 1, 25):
                point = (x0 + t * (x1 - x0), y0 + t * (y1 - y0))
                hit = [k for k in picture.boxes if k not in (src, dst) and inside(point, k)]
                assert not hit, (src, dst, hit)
    # Group frames hold only their group's boxes: members share one column.
    for i in picture.groups:
        members = [k for k, b in picture.boxes.items() if b.group == i]
        assert len({round(layout.centre[k][0], 6) for k in members}) == 1


def test_plot_without_matplotlib_is_one_line_exit_2(in_workdir, capsys, monkeypatch, tmp_path):
    import rnnfuse.plotting

    real_import = builtins.__import__

    def no_plotting(name, *args, **kwargs):
        if name.startswith(("matplotlib", "pydot")):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_plotting)
    code, out, err = _run(capsys, "inspect", "stack.keras", "--plot", tmp_path / "g.png")
    assert code == 2
    assert err.strip().splitlines() == [
        "rnnfuse: error: --plot: drawing needs matplotlib, which is not installed. "
        "Fix: pip install 'rnnfuse[plot]'"
    ]


# -- check ---------------------------------------------------------------------


def test_check_passes_through_the_fused_path(in_workdir, capsys, emulated_cudnn):
    code, out, err = _run(capsys, "check", "fusable.keras", "--batch", "2", "--plan", "fused", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert emulated_cudnn, "the fused path did not run"
    assert result["passed"] is True
    assert set(result["fused_paths"].values()) == {"fused"}
    [group] = result["groups"]
    assert group["layers"] == ["lstm_a", "lstm_b"]
    assert group["plan"] == {"name": "fused", "pieces": [2], "algorithm": None, "source": "forced"}
    assert result["caveat"] is None and result["compared_fused_path"] is True
    assert result["outputs_max_abs_diff"] <= result["tolerance"] == cli.check.DEFAULT_TOLERANCE["float32"]
    assert result["gradients_max_abs_diff"] <= result["tolerance"]
    assert result["gradients_max_abs"] > 0  # the gradients are not all zero


def test_check_fails_above_the_tolerance(in_workdir, capsys, emulated_cudnn, monkeypatch):
    from rnnfuse.backends import tensorflow as tf_backend

    exact = tf_backend.cudnn_rnn

    def off_by_a_little(**kwargs):
        out, h, c, reserve, host = exact(**kwargs)
        return out + 1e-3, h + 1e-3, c, reserve, host

    monkeypatch.setattr(tf_backend, "cudnn_rnn", off_by_a_little)
    code, out, err = _run(
        capsys, "check", "fusable.keras", "--batch", "2", "--plan", "fused", "--tolerance", "1e-5"
    )
    assert code == 1, err
    assert "FAIL: above the tolerance 1e-05" in out
    diff = float(re.search(r"outputs:\s+max abs diff (\S+)", out).group(1))
    assert diff > 1e-5


def test_check_on_cpu_runs_the_original_layers(in_workdir, capsys):
    code, out, err = _run(capsys, "check", "models:text", "--steps", "6", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["outputs_max_abs_diff"] == 0.0
    assert result["gradients_max_abs_diff"] == 0.0
    [tokens] = result["inputs"]
    assert tokens["shape"] == [4, 6] and tokens["dtype"] == "int32"
    assert "right-padded" in tokens["values"]
    # Said in so many words: the check compared the original layers with themselves.
    assert result["compared_fused_path"] is False
    assert any("against themselves" in note for note in result["notes"])


def test_random_inputs_follow_shapes_and_embeddings(in_workdir):
    import models

    model = models.text()
    notes = []
    tokens, described = cli.random_inputs(model, batch=5, steps=7, rng=np.random.default_rng(3), notes=notes)
    tokens = np.asarray(tokens)
    assert tokens.shape == (5, 7) and tokens.dtype == np.int32
    vocab = model.get_layer("embed").input_dim
    assert tokens.min() >= 0 and tokens.max() < vocab
    for row in tokens:
        length = int(np.count_nonzero(row))
        assert length >= 1 and np.all(row[:length] > 0) and np.all(row[length:] == 0)
    fixed = models.stack()
    x, _ = cli.random_inputs(fixed, batch=2, steps=3, rng=np.random.default_rng(0), notes=notes)
    assert np.asarray(x).shape == (2, 8, 3)  # the model's own time dimension
    assert any("--steps 3" in n for n in notes)


# -- bench ---------------------------------------------------------------------


def test_bench_prints_device_medians_and_ratio(in_workdir, capsys):
    code, out, err = _run(
        capsys, "bench", "fusable.keras", "--batch", "2", "--repeats", "2", "--warmup", "1"
    )
    assert code == 0, err
    assert "device:" in out and "median" in out and "speedup" in out
    assert re.search(r"speedup .*: \d+\.\d\dx", out)
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        assert "no GPU" in out and "1.0x" in out
        # The caveat comes before the timings, not after them.
        assert out.index("before timing:") < out.index("milliseconds per step")


def test_bench_json_train_and_mixed_precision(in_workdir, capsys):
    code, out, err = _run(
        capsys, "bench", "models:text", "--batch", "2", "--steps", "5", "--repeats", "3",
        "--warmup", "1", "--train", "--mixed-precision", "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["mode"] == "train" and result["compute_dtype"] == "float16"
    assert len(result["original_ms"]) == len(result["optimized_ms"]) == 3
    assert result["speedup"] == pytest.approx(result["original_median_ms"] / result["optimized_median_ms"])


def test_mixed_precision_rebuilds_a_saved_model(in_workdir):
    model = cli.load_model("fusable.keras", mixed_precision=True)
    assert {l.dtype_policy.name for l in model.layers} == {"mixed_float16"}
    original = keras.saving.load_model(in_workdir / "fusable.keras")
    for a, b in zip(model.weights, original.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- errors: exit 2, one line, no traceback --------------------------------------


def _bad_files(path):
    (path / "text.keras").write_text("not a model")
    with zipfile.ZipFile(path / "nozip.keras", "w") as z:
        z.writestr("readme.txt", "no config here")
    (path / "saved").mkdir(exist_ok=True)
    (path / "saved" / "saved_model.pb").write_bytes(b"")
    (path / "w.weights.h5").write_bytes(b"\x89HDF\r\n\x1a\n")


ERRORS = [
    (["inspect", "missing.keras"], "no such file"),
    (["inspect", "text.keras"], "not a Keras model file"),
    (["inspect", "nozip.keras"], "not a .keras model (config.json, model.weights.h5 missing)"),
    (["inspect", "saved"], "SavedModel"),
    (["inspect", "w.weights.h5"], "weights only"),
    (["inspect", "custom.keras"], "custom object 'Scale', which is not registered in this process. Fix: pass --import custom_layers"),
    (["inspect", "lambda.keras"], "--unsafe"),
    (["inspect", "nosuchmodule:build"], "cannot import module 'nosuchmodule'"),
    (["inspect", "models:nothere"], "no function 'nothere'"),
    (["inspect", "models:not_a_model"], "not a keras.Model"),
    (["inspect", "models:unbuilt"], "not built"),
    (["inspect", "models:boom"], "ZeroDivisionError"),
    (["inspect", "models:needs_arg"], "no required arguments"),
    (["inspect", "nothing-here"], "neither an existing file nor module:function"),
    (["inspect", "models:subclassed", "--plot", "x.png"], "subclassed"),
    (["inspect", "stack.keras", "--min-layers", "0"], "--min-layers"),
    (["inspect", "stack.keras", "--frobnicate"], "unrecognized arguments"),
    (["inspect"], "MODEL"),
    ([], "choose a command"),
    (["bench", "models:text", "--batch", "x"], "--batch"),
    (["bench", "models:text"], "pass --steps"),
    (["check", "stack.keras", "--tolerance", "-1"], "--tolerance"),
    (["check", "models:open_features"], "open dimension"),
    (["check", "models:subclassed"], "input shapes"),
    # Sizes are checked against available memory before allocating.
    (["check", "fusable.keras", "--batch", "1000000000"], "needs at least"),
    (["check", "models:text", "--steps", "1000000000"], "needs at least"),
    (["bench", "models:text", "--steps", "1000000000"], "needs at least"),
    (["inspect", "stack.keras", "--plot", "out.txt"], "'.txt' is not an image format"),
]


@pytest.mark.parametrize("argv, expected", ERRORS, ids=[" ".join(a) or "none" for a, _ in ERRORS])
def test_errors_are_one_line_exit_2(in_workdir, capsys, argv, expected):
    _bad_files(in_workdir)
    code, out, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rnnfuse: error: ")
    assert expected in lines[0]
    assert "Traceback" not in err
    assert "Fix:" in lines[0] or "--help" in lines[0]


def test_unreadable_file(in_workdir, capsys, monkeypatch):
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file).endswith("stack.keras"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    code, out, err = _run(capsys, "inspect", "stack.keras")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cannot read 'stack.keras': Permission denied" in err


def test_fixes_in_the_messages_work(in_workdir, capsys):
    code, out, err = _run(capsys, "inspect", "custom.keras", "--import", "custom_layers", "--json")
    assert code == 0, err  # the module the error message names
    assert [g["layers"] for g in json.loads(out)["groups"]] == [["lstm_c"]]
    _unregister_custom_layers()
    sys.modules.pop("custom_layers", None)
    code, out, err = _run(capsys, "inspect", "custom.keras", "--import", "./custom_layers.py", "--json")
    assert code == 0, err
    code, out, err = _run(capsys, "inspect", "lambda.keras", "--unsafe", "--json")
    assert code == 0, err


def test_debug_shows_the_traceback(in_workdir, capsys):
    code, out, err = _run(capsys, "inspect", "models:boom", "--debug")
    assert code == 2
    assert "Traceback" in err and "ZeroDivisionError" in err and "in boom" in err
    assert err.strip().splitlines()[-1].startswith("rnnfuse: error: ")


def test_quiet_and_verbose_set_the_rnnfuse_logger(in_workdir, capsys, monkeypatch):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("the before-timing notice appears only without a GPU")
    bench = ("bench", "fusable.keras", "--batch", "2", "--repeats", "1", "--warmup", "1", "--json")
    code, out, err = _run(capsys, *bench)
    # JSON on stdout, the notice (INFO on the rnnfuse logger) on stderr.
    assert code == 0 and json.loads(out)["command"] == "bench"
    assert err.startswith("rnnfuse: before timing: no group runs fused here"), err
    # optimize()'s own warning is left out: the command says it per group.
    assert "optimize('fusable')" not in err
    code, out, err = _run(capsys, *bench, "-q")
    assert code == 0 and err == ""
    seen = []
    monkeypatch.setattr(cli.inspect, "run", lambda args: seen.append(logging.getLogger("rnnfuse").level) or 0)
    assert cli.main(["-v", "inspect", "fusable.keras"]) == 0 and seen == [logging.DEBUG]
    # The command puts the logger back as it found it.
    logger = logging.getLogger("rnnfuse")
    assert logger.propagate and not [h for h in logger.handlers if getattr(h, "_rnnfuse_cli", False)]


def test_unexpected_errors_exit_3(in_workdir, capsys, monkeypatch):
    monkeypatch.setattr(cli.pipeline, "analyze", lambda model, n: {}["boom"])
    code, out, err = _run(capsys, "inspect", "stack.keras")
    assert code == 3
    assert len(err.strip().splitlines()) == 1 and "KeyError" in err and "--debug" in err


# -- what a newcomer hit -----------------------------------------------------------


def test_dynamic_text_is_printed_as_written_not_as_markup(in_workdir, capsys, monkeypatch):
    """rich markup ate `[bold]` from a layer name and `[torch]` from the
    advice `pip install 'rnnfuse[torch]'` ()."""
    code, out, err = _run(capsys, "inspect", "models:odd_names")
    assert code == 0, err
    text = " ".join(out.split())
    assert "enc[bold] -> enc[italic]" in text and "odd[red]" in text
    assert "enc[bold] -> enc[italic]" in str(rnnfuse.analyze(importlib.import_module("models").odd_names()))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a)
    )
    code, out, err = _run(capsys, "check", "fusable.keras")
    assert code == 0, err
    assert "pip install 'rnnfuse[torch]'" in " ".join(out.split())


def test_quiet_prints_only_the_result_line(in_workdir, capsys):
    code, out, err = _run(capsys, "inspect", "stack.keras", "-q")
    assert code == 0 and err == ""
    assert out.splitlines() == [
        "2 group(s) of 3 layer(s) can fuse; here (tensorflow) they run unfused; "
        "0 other recurrent layer(s) cannot fuse."
    ]
    code, out, err = _run(capsys, "-q", "check", "fusable.keras")
    assert code == 0 and err == ""
    assert out.splitlines() == ["PASS: both within the tolerance 0.0001 (original layers against themselves)"]
    code, out, err = _run(capsys, "bench", "fusable.keras", "--batch", "2", "--repeats", "1", "--warmup", "1", "-q")
    assert code == 0 and err == ""
    [line] = out.splitlines()
    assert re.fullmatch(r"speedup \(original / optimized, medians\): \d+\.\d\dx", line)


def test_errors_under_json_are_json_records(in_workdir, capsys):
    for argv, command, code in [
        (["check", "missing.keras", "--json"], "check", 2),
        (["inspect", "stack.keras", "--json", "--frobnicate"], "inspect", 2),
        (["--json"], None, 2),
    ]:
        got, out, err = _run(capsys, *argv)
        record = json.loads(out)
        assert got == code and record["command"] == command
        assert record["error"]["exit_code"] == code
        # The same one line as on stderr.
        assert err.strip().splitlines() == [f"rnnfuse: error: {record['error']['message']}"]


def test_the_steps_note_appears_only_when_steps_was_given(in_workdir, capsys):
    code, out, err = _run(capsys, "check", "fusable.keras", "--json")
    assert code == 0, err
    assert not [n for n in json.loads(out)["notes"] if "--steps" in n]
    code, out, err = _run(capsys, "check", "fusable.keras", "--steps", "3", "--json")
    assert [n for n in json.loads(out)["notes"] if "--steps 3 does not apply" in n]
    # An open time dimension still gets check's default of 16 steps.
    code, out, err = _run(capsys, "check", "models:text", "--json")
    assert code == 0 and json.loads(out)["inputs"][0]["shape"] == [4, 16]


def test_verbosity_flags_work_after_every_command():
    from rnnfuse.cli.arguments import build_parser

    parser = build_parser(cli.COMMANDS)
    for command in cli.COMMANDS:
        argv = [command.NAME] + (["m.keras"] if "model" in command.PARENTS else [])
        args = parser.parse_args([*argv, "--debug", "-q"])
        assert (args.debug, args.quiet, args.verbose) == (True, 1, 0), command.NAME
        args = parser.parse_args(["-v", *argv])
        assert (args.debug, args.quiet, args.verbose) == (False, 0, 1), command.NAME


def test_build_ops_without_tensorflow_is_exit_2_with_the_install_fix(capsys, monkeypatch):
    """Was: exit 3, "unexpected ModuleNotFoundError ... This may be a bug",
    and `build-ops --debug` refused."""
    from rnnfuse.backends.cuda import build

    def no_core(force=False):
        raise build.BuildError("no C++ compiler found")

    monkeypatch.setattr(build, "build_cudnn_core", no_core)
    monkeypatch.setattr(build, "build_library", no_core)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import tensorflow fails
    for name in [m for m in sys.modules if m.startswith("rnnfuse.backends.tensorflow")]:
        monkeypatch.delitem(sys.modules, name)
    code, out, err = _run(capsys, "build-ops", "--debug")
    assert code == 2
    assert "the cuDNN RNN core was not built (no C++ compiler found)" in err
    assert "the wavefront library was not built (no C++ compiler found)" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rnnfuse: error: build-ops compiles rnnfuse's op for TensorFlow")
    assert "Fix: pip install 'tensorflow" in last and "This may be a bug" not in err
    assert "Traceback" in err  # --debug after the command name is honoured


def test_build_ops_without_tensorflow_builds_the_core_for_torch(capsys, monkeypatch, tmp_path):
    from rnnfuse.backends.cuda import build

    core, wavefront = tmp_path / "librnnfuse_cudnn_core.so", tmp_path / "librnnfuse_wavefront.so"
    monkeypatch.setattr(build, "build_cudnn_core", lambda force=False: core)
    # The wavefront library too: torch's and JAX's kernel checks load it.
    monkeypatch.setattr(build, "build_library", lambda force=False: wavefront)
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    for name in [m for m in sys.modules if m.startswith("rnnfuse.backends.tensorflow")]:
        monkeypatch.delitem(sys.modules, name)
    code, out, err = _run(capsys, "build-ops")
    assert code == 0 and out.strip().splitlines() == [str(core), str(wavefront)]
    assert "TensorFlow is not installed here: its ops were not built" in err


# -- installed entry points (subprocesses) -----------------------------------------


def test_console_script_is_declared():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "rnnfuse"]
    assert script.load() is cli.main


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_keras(flag):
    """The script's import of rnnfuse defers keras until a command runs."""
    code = (
        f"import sys; sys.argv = ['rnnfuse', '{flag}']; from rnnfuse.cli import main; "
        "rc = main(); print('keras' in sys.modules, 'numpy' in sys.modules, rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    # Without keras and numpy imported, the answer cannot wait on them.
    assert done.stdout.split()[-3:] == ["False", "False", "0"], done.stderr
    assert done.stderr == ""


def test_python_m_rnnfuse_subprocesses(workdir):
    """`python -m rnnfuse`: an error is one line (TensorFlow); check on torch.

    Both run at once to save the start-up time. The torch run (when torch is
    installed) checks the fused call PyTorch runs on the CPU itself.
    """
    import importlib.util

    # The rnnfuse under test, not whichever one the environment installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path)
    commands = {
        "error": (["inspect", "missing.keras"], dict(base, KERAS_BACKEND="tensorflow")),
        # The user's setting: exit 2 with the fix, not an internal error.
        "bogus backend": (["inspect", "stack.keras"], dict(base, KERAS_BACKEND="bogus")),
    }
    if importlib.util.find_spec("torch") is not None:
        commands["torch"] = (
            ["check", "models:text", "--steps", "5", "--plan", "fused", "--json"],
            dict(base, KERAS_BACKEND="torch", RNNFUSE_TORCH_CALLS="bogus"),
        )
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "rnnfuse", *argv],
            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, (argv, env) in commands.items()
    }
    results = {name: (p.communicate(timeout=300), p.returncode) for name, p in runs.items()}

    (out, err), code = results["error"]
    assert code == 2, err
    assert out == ""
    # Exactly one line: TensorFlow's C++ start-up lines are dropped too.
    ours = [l for l in err.splitlines() if l.strip()]
    assert len(ours) == 1 and ours[0].startswith("rnnfuse: error: no such file"), err
    assert "Traceback" not in err

    (out, err), code = results["bogus backend"]
    assert code == 2, err
    assert err.strip().splitlines() == [
        "rnnfuse: error: KERAS_BACKEND names the Keras backend 'bogus', which Keras does not "
        "know. Fix: set KERAS_BACKEND to tensorflow, torch or jax, or unset it"
    ], err

    if "torch" in results:
        (out, err), code = results["torch"]
        assert code == 0, err
        result = json.loads(out)
        assert result["device"].startswith(("CPU", "GPU")) and "PyTorch" in result["device"]
        assert set(result["fused_paths"].values()) == {"fused"}
        assert result["passed"] and result["outputs_max_abs_diff"] <= 1e-5
        # A typo in RNNFUSE_TORCH_CALLS is said without --debug.
        assert ("rnnfuse: warning: the environment variable RNNFUSE_TORCH_CALLS='bogus' is "
                "not a call mode") in err, err


# -- what inspect says about subclassed and optimized models ----------------------


def test_inspect_of_a_subclassed_model_says_it_cannot_look_inside(in_workdir, capsys):
    code, out, _ = _run(capsys, "inspect", "models:subclassed")
    assert code == 0
    assert re.search(r"cannot look inside '\w+': it is a subclassed model \(Sub\)", " ".join(out.split()))


def test_inspect_of_a_saved_optimized_model_names_its_fused_layers(in_workdir, capsys, tmp_path):
    model = keras.models.load_model(in_workdir / "fusable.keras")
    rnnfuse.optimize(model).save(tmp_path / "fast.keras", fused=True)
    code, out, _ = _run(capsys, "inspect", tmp_path / "fast.keras")
    text = " ".join(out.split())
    assert code == 0
    assert "already optimized" in text and "no fusable runs" not in text
    assert "'fused_lstm_a_to_lstm_b' is a FusedRNN (already optimized): it runs lstm_a -> lstm_b" in text
    assert "1 FusedRNN layer(s) already run 2 recurrent layer(s)" in text
    code, out, _ = _run(capsys, "inspect", tmp_path / "fast.keras", "--json")
    assert any("FusedRNN" in n for n in json.loads(out)["notes"])


def test_check_refuses_sizes_that_do_not_fit_before_allocating(in_workdir, capsys, monkeypatch):
    import tracemalloc

    from rnnfuse.cli import inputs as engines

    monkeypatch.setattr(engines, "available_memory", lambda: 10 * 2**20)  # 10 MiB
    tracemalloc.start()
    try:
        # 200000 x 6 x 3 inputs alone would be 29 MB in float64.
        code, _, err = _run(capsys, "check", "fusable.keras", "--batch", "200000")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 2 and "needs at least" in err and "is available" in err
    assert peak < 20 * 2**20


# -- a newcomer's first runs -------------------------------------------------------


def test_the_plan_cache_warning_reaches_the_command_line(in_workdir, capsys, monkeypatch):
    """The warning the Python API gives for an unusable cache is one line here too."""
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", "/dev/null/x")
    code, _, err = _run(capsys, "bench", "fusable.keras", "--tune", "--batch", "2", "--repeats", "1",
                        "--warmup", "1")
    assert code == 0
    (line,) = [l for l in err.splitlines() if "plan cache" in l]
    assert line.startswith("rnnfuse: warning: RNNFUSE_CACHE_DIR='/dev/null/x' cannot hold the plan cache")
    assert "Fix: point RNNFUSE_CACHE_DIR at a folder" in line


def test_rnnfuse_warnings_are_log_lines_and_others_stay_hidden(caplog):
    import warnings

    from rnnfuse.cli.quiet import rnnfuse_warnings_logged
    from rnnfuse.reasons import FusionWarning

    with caplog.at_level(logging.WARNING, logger="rnnfuse"), rnnfuse_warnings_logged(debug=False):
        for _ in range(2):  # every time, not once per place
            warnings.warn("rnnfuse: a setting\n  to fix", FusionWarning)
        warnings.warn("a library's own remark", UserWarning)
    assert [r.getMessage() for r in caplog.records] == ["a setting to fix"] * 2


def test_inspect_says_plainly_that_groups_run_as_the_original_layers_here(in_workdir, capsys):
    code, out, _ = _run(capsys, "inspect", "models:split_by_dropout", "-q")
    assert code == 0
    assert out.strip() == (
        "2 group(s) of 4 layer(s) can fuse; here (tensorflow) they run unfused; "
        "0 other recurrent layer(s) cannot fuse."
    )


def test_inspect_json_keeps_the_texts_remarks(in_workdir, capsys):
    code, text, _ = _run(capsys, "inspect", "models:split_by_dropout")
    code, out, _ = _run(capsys, "inspect", "models:split_by_dropout", "--json")
    record = json.loads(out)
    (brk,) = record["breaks"]
    assert brk["layers"] == ["lstm_b", "lstm_c"] and brk["rule"] == "dropout_between"
    assert record["notes"][0].startswith("separate groups: 'lstm_b' -> 'lstm_c' (dropout_between)")
    assert record["notes"][-1].startswith("here, no group runs fused: ")
    # Every remark the text prints is in the record.
    flat = " ".join(text.split())
    assert all(" ".join(note.split()) in flat for note in record["notes"])


def test_check_of_a_model_with_nothing_to_fuse_says_what_pass_means(in_workdir, capsys):
    code, out, _ = _run(capsys, "check", "models:dense")
    flat = " ".join(out.split())
    assert code == 0
    assert "note: nothing fuses in this model, so this compared the model against itself" in flat
    assert out.splitlines()[-1].endswith("(original layers against themselves)")


def test_a_fallback_is_said_in_words(in_workdir, capsys):
    code, out, _ = _run(capsys, "check", "fusable.keras")
    assert code == 0
    assert ("lstm_b ran the original layers: the fused kernel needs a CUDA GPU and tensorflow "
            "sees none") in " ".join(out.split())


def test_a_missing_model_file_fails_before_keras_is_imported():
    code = (  # as the `rnnfuse` script starts
        "import sys; sys.argv = ['rnnfuse', 'inspect', 'missing.keras']; "
        "from rnnfuse.cli import main; rc = main(); "
        "print('keras' in sys.modules, 'tensorflow' in sys.modules, rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.stdout.split()[-3:] == ["False", "False", "2"], done.stderr
    assert done.stderr.startswith("rnnfuse: error: no such file: 'missing.keras'")


def test_the_makefiles_pins_say_why_without_machine_history():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "Makefile")) as f:
        lines = f.read().splitlines()
    pins = [i for i, l in enumerate(lines) if re.search(r"pip install -q \S+==", l)]
    assert len(pins) >= 2
    for i in pins:
        target = max(j for j in range(i) if lines[j] and not lines[j][0].isspace())
        comment = []
        for j in range(target - 1, -1, -1):
            if not lines[j].startswith("#"):
                break
            comment.insert(0, lines[j])
        text = " ".join(comment).lower()
        assert "pinned" in text, (lines[i], comment)
        assert "this machine" not in text and "local disk" not in text, comment
