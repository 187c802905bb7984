"""Building and loading rnnfuse's cuDNN op, on the CPU (no GPU needed).

- the real op compiles here from the package's csrc/ (TensorFlow's headers,
  cuDNN headers from nvidia-cudnn-cu12) with the cuDNN core compiled in,
  and registers both ops; the op's source calls cuDNN only through the core;
- the build cache: a second build reuses the library, an edit of the core
  rebuilds it;
- the lock: two processes building at once compile once;
- a missing compiler: build_op raises the documented BuildError, load_op
  warns once (logger "rnnfuse" and warnings.warn) and returns None;
- `import rnnfuse` and CPU use never build.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import tensorflow as tf

from fake_compiler import fake_compiler
from rnnfuse.backends.tensorflow import op_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("RNNFUSE_CACHE_DIR", str(tmp_path / "cache"))
    op_build.reset_for_tests()
    yield tmp_path
    op_build.reset_for_tests()


def _fake_cudnn(root: Path) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "include" / "cudnn_version.h").write_text(
        "#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 99\n#define CUDNN_PATCHLEVEL 1\n"
    )
    (root / "include" / "cudnn.h").write_text("")
    (root / "lib" / "libcudnn.so.9").write_text("")
    return root


def test_the_op_compiles_here_and_registers_both_ops(fresh):
    """CI needs nvidia-cudnn-cu12 (the `test` extra) and g++."""
    path = op_build.build_op()
    assert path.is_file() and path.name == "rnnfuse_cudnn_rnn.so"
    assert path.parent.parent == fresh / "cache" / "ops"
    assert f"tf{tf.__version__}-cudnn9." in path.parent.name
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert "libcudnn.so.9" in needed and "libcudart" not in needed
    # The cuDNN core is compiled in: the library defines its entries.
    defined = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                             text=True).stdout
    for entry in ("rnnfuse_cudnn_sizes", "rnnfuse_cudnn_forward", "rnnfuse_cudnn_backward_data",
                  "rnnfuse_cudnn_backward_weights"):
        assert entry in defined
    # Load it in a child (libcudnn.so.9 is found through the rpath): both ops
    # register; their kernels are GPU-only, so nothing runs here.
    code = (
        "import tensorflow as tf, sys; m = tf.load_op_library(sys.argv[1]); "
        "print(hasattr(m, 'rnnfuse_cudnn_rnn'), hasattr(m, 'rnnfuse_cudnn_rnn_backprop'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert out.stdout.strip().endswith("True True"), out.stderr[-2000:]


def test_the_op_calls_cudnn_only_through_the_core():
    """The kernels adapt tensors; every cuDNN call (descriptors, plans, the
    weight-space layout) is the core's, so none is left in the op's source."""
    source = (op_build.SOURCE_DIR / "rnnfuse_cudnn_rnn.cc").read_text()
    assert re.findall(r"\bcudnn[A-Z]\w*\s*\(", source) == []
    assert "rnnfuse_cudnn_forward" in source and "rnnfuse_cudnn_backward_weights" in source


def test_the_cache_key_covers_the_cores_source(fresh, monkeypatch):
    """Editing the core rebuilds the op that compiles it in."""
    from rnnfuse.backends.cuda import build

    monkeypatch.setenv("CUDNN", str(_fake_cudnn(fresh / "cudnn")))
    core = fresh / "core"
    core.mkdir()
    for name in build.CORE_SOURCES:
        (core / name).write_text(f"// {name}\n")
    monkeypatch.setattr(op_build, "CORE_SOURCES", tuple(core / n for n in build.CORE_SOURCES))
    before = op_build.library_path()
    (core / "cudnn_rnn_core.cc").write_text("// edited\n")
    assert op_build.library_path() != before


def test_a_second_build_reuses_the_cached_library(fresh, monkeypatch):
    log = fresh / "log"
    monkeypatch.setenv("CUDNN", str(_fake_cudnn(fresh / "cudnn")))
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, log)))
    first = op_build.build_op()
    second = op_build.build_op()
    assert first == second and log.read_text().count("built") == 1
    assert "cudnn9.99.1" in first.parent.name
    op_build.build_op(force=True)
    assert log.read_text().count("built") == 2


def test_two_processes_build_once(fresh):
    log = fresh / "log"
    env = dict(
        os.environ,
        RNNFUSE_CACHE_DIR=str(fresh / "cache"),
        CUDNN=str(_fake_cudnn(fresh / "cudnn")),
        CXX=str(fake_compiler(fresh, log, delay=3.0)),
        PYTHONPATH=str(ROOT),
        CUDA_VISIBLE_DEVICES="",
    )
    code = "from rnnfuse.backends.tensorflow import op_build; print('PATH', op_build.build_op())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    paths = {line for out, _ in outs for line in out.splitlines() if line.startswith("PATH")}
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    assert len(paths) == 1
    assert log.read_text().count("built") == 1


def test_a_missing_compiler_warns_once_and_keeps_cudnnrnnv3(fresh, monkeypatch, caplog):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(fresh / "empty"))
    with pytest.raises(op_build.BuildError, match=r"no C\+\+ compiler found.*Fix: install"):
        op_build.build_op()
    # Pretend a GPU is visible, so load_op really tries.
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU:0"])
    monkeypatch.setattr(tf.test, "is_built_with_cuda", lambda: True)
    with caplog.at_level(logging.WARNING, logger="rnnfuse"):
        with pytest.warns(RuntimeWarning, match=r"not available \(no C\+\+ compiler found"):
            assert op_build.load_op() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert op_build.load_op() is None  # no second warning
    records = [r for r in caplog.records if r.name == "rnnfuse" and "CudnnRNNV3" in r.getMessage()]
    assert len(records) == 1 and "Fix:" in records[0].getMessage()
    assert "no C++ compiler" in op_build.load_failure()


def test_missing_cudnn_headers_name_the_fix(fresh, monkeypatch):
    monkeypatch.setenv("CUDNN", str(fresh / "nowhere"))
    monkeypatch.setattr(op_build, "find_cudnn", op_build.find_cudnn)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    with pytest.raises(op_build.BuildError, match=r"pip install 'rnnfuse\[cuda\]'"):
        op_build.find_cudnn()


def test_no_gpu_means_no_build_and_no_warning(fresh, monkeypatch):
    monkeypatch.setattr(op_build, "build_op", lambda **k: pytest.fail("built without a GPU"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert op_build.load_op() is None
    assert op_build.load_failure() == "no GPU visible to TensorFlow"


def test_import_and_cpu_use_never_build():
    code = textwrap.dedent(
        """
        import json, numpy as np, keras, rnnfuse
        from rnnfuse.backends.tensorflow import op_build
        m = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4, return_sequences=True), keras.layers.LSTM(4)])
        rnnfuse.optimize(m)(np.zeros((2, 5, 3), "float32"))
        print(json.dumps({"built": op_build._STATE["module"] is not None, "reason": op_build.load_failure()}))
        """
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["built"] is False


def test_cli_build_ops_prints_the_library_paths(fresh, monkeypatch, capsys):
    from rnnfuse.cli import main

    monkeypatch.setenv("CUDNN", str(_fake_cudnn(fresh / "cudnn")))
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, fresh / "log")))
    monkeypatch.setenv("NVCC", str(fake_compiler(fresh, fresh / "log")))
    assert main(["build-ops"]) == 0
    wavefront, cudnn = capsys.readouterr().out.strip().splitlines()[-2:]
    assert cudnn.endswith("rnnfuse_cudnn_rnn.so") and Path(cudnn).is_file()
    assert wavefront.endswith("rnnfuse_wavefront_op.so") and Path(wavefront).is_file()


def test_cli_build_ops_without_nvcc_still_builds_the_cudnn_op(fresh, monkeypatch, capsys):
    from rnnfuse.backends.cuda import build
    from rnnfuse.cli import main

    monkeypatch.setenv("CUDNN", str(_fake_cudnn(fresh / "cudnn")))
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, fresh / "log")))
    def no_nvcc():
        raise build.BuildError("no nvcc found")

    monkeypatch.setattr(build, "find_nvcc", no_nvcc)
    assert main(["build-ops"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1].endswith("rnnfuse_cudnn_rnn.so")
    assert "wavefront op was not built (no nvcc found)" in err
