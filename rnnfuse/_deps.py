"""Imports keras, naming the extra to install (`pip install
'rnnfuse[torch]'`, `[tensorflow]`, `[jax]`) when the selected Keras
backend's package is missing, instead of Keras' bare "No module named".

>>> _extra_for("jax")
'jax'
"""

from __future__ import annotations

import json
import os

__all__ = ["import_keras", "selected_backend"]

# Keras backend -> (the module it imports, the rnnfuse extra that installs it).
_BACKEND_PACKAGES = {
    "tensorflow": ("tensorflow", "tensorflow"),
    "torch": ("torch", "torch"),
    "jax": ("jax", "jax"),
}


def selected_backend() -> str:
    """The Keras backend this process will use, read the way Keras reads it."""
    name = os.environ.get("KERAS_BACKEND")
    if not name:
        home = os.environ.get("KERAS_HOME") or os.path.join(
            os.path.expanduser("~"), ".keras"
        )
        try:
            with open(os.path.join(home, "keras.json")) as f:
                name = json.load(f).get("backend")
        except (OSError, ValueError, AttributeError):
            name = None
    return name or "tensorflow"


def _extra_for(backend: str) -> str:
    return _BACKEND_PACKAGES.get(backend, (backend, backend))[1]


def import_keras():
    """`import keras`, with the rnnfuse extra to install when it fails.

    Raises:
        ImportError: keras, or the package of the selected Keras backend, is
            not installed, or the selected backend is not one Keras knows.
    """
    try:
        import keras
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing == "keras":
            raise ImportError(
                "rnnfuse: keras is not installed; pip install 'rnnfuse[tensorflow]' "
                "(or [torch], [jax] for another Keras backend)"
            ) from err
        backend = selected_backend()
        known = {module for module, _ in _BACKEND_PACKAGES.values()} | {"jaxlib"}
        if missing in known:
            chosen = (
                f"KERAS_BACKEND={backend}"
                if os.environ.get("KERAS_BACKEND")
                else f"the Keras backend is {backend} (KERAS_BACKEND is not set)"
            )
            others = ", ".join(b for b in _BACKEND_PACKAGES if b != backend)
            raise ImportError(
                f"rnnfuse: {chosen} but {missing} is not installed; pip install "
                f"'rnnfuse[{_extra_for(backend)}]', or set KERAS_BACKEND to "
                f"another backend ({others})"
            ) from err
        raise
    except ValueError as err:  # Keras' "Unable to import backend : <name>"
        backend = selected_backend()
        if backend in _BACKEND_PACKAGES or "backend" not in str(err):
            raise
        where = "KERAS_BACKEND" if os.environ.get("KERAS_BACKEND") else "Keras' keras.json"
        raise ImportError(
            f"rnnfuse: {where} names the Keras backend {backend!r}, which Keras does not "
            "know. Fix: set KERAS_BACKEND to tensorflow, torch or jax, or unset it"
        ) from err
    return keras
