"""`import rnnfuse` without the selected backend names the extra to install.

The real check (a venv with only torch, one with only JAX) is in the
report of the packaging change; here Keras' import failure is simulated.
"""

from __future__ import annotations

import builtins

import pytest

from rnnfuse import _deps


def _keras_fails(monkeypatch, missing: str):
    real_import = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "keras":
            raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


@pytest.mark.parametrize("backend, module, extra", [("torch", "torch", "torch"), ("jax", "jax", "jax"),
                                                    ("tensorflow", "tensorflow", "tensorflow")])
def test_missing_backend_names_the_extra(monkeypatch, backend, module, extra):
    monkeypatch.setenv("KERAS_BACKEND", backend)
    _keras_fails(monkeypatch, module)
    with pytest.raises(ImportError) as info:
        _deps.import_keras()
    assert str(info.value).startswith(
        f"rnnfuse: KERAS_BACKEND={backend} but {module} is not installed; "
        f"pip install 'rnnfuse[{extra}]'"
    )


def test_unset_backend_says_it_is_keras_default(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))  # no keras.json there
    _keras_fails(monkeypatch, "tensorflow")
    with pytest.raises(ImportError, match=r"the Keras backend is tensorflow \(KERAS_BACKEND is not set\)"):
        _deps.import_keras()


def test_keras_json_names_the_backend(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    (tmp_path / "keras.json").write_text('{"backend": "jax"}')
    assert _deps.selected_backend() == "jax"


def test_other_import_errors_pass_through(monkeypatch):
    _keras_fails(monkeypatch, "h5py")
    with pytest.raises(ModuleNotFoundError, match="h5py"):
        _deps.import_keras()


def test_an_unknown_backend_is_the_users_setting_with_the_fix(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "bogus")
    real_import = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "keras":
            raise ValueError("Unable to import backend : bogus")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"KERAS_BACKEND names the Keras backend 'bogus'.*"
                                          r"Fix: set KERAS_BACKEND to tensorflow, torch or jax"):
        _deps.import_keras()
