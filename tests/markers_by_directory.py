"""The pytest markers a test file gets from the folder it lives in.

Used by tests/conftest.py (and tested by tests/test_markers.py); a module of
its own because `from conftest import ...` finds whichever conftest.py comes
first on sys.path when the whole tests/ tree is collected.

    >>> backend_markers("torch_backend/test_torch_fused.py")
    ('torch',)
    >>> backend_markers("gpu/test_gpu_fused.py")
    ('gpu', 'tensorflow')
"""

from __future__ import annotations


def backend_markers(relpath: str) -> tuple[str, ...]:
    """The markers a test file gets from where it lives (path relative to
    tests/, with "/" separators)."""
    parts = relpath.split("/")
    if parts[0] == "torch_backend":
        return ("torch",)
    if parts[0] == "jax_backend":
        return ("jax",)
    if parts[0] == "gpu":
        name = parts[-1]
        backend = "torch" if "torch" in name else "jax" if "jax" in name else "tensorflow"
        return ("gpu", backend)
    return ("tensorflow",)
