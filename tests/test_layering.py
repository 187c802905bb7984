"""The dependency rule of rnnfuse/__init__.py, enforced over the source.

Every `import` of an rnnfuse module (at module level or inside a function)
must go to a module on the same layer or a lower one. Importing
`rnnfuse.a.b` also runs the package `rnnfuse.a`'s __init__, so that package
counts as imported too (the root package `rnnfuse` aside: it is imported by
every `rnnfuse.x` import and holds nothing but re-exports).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import rnnfuse

ROOT = pathlib.Path(rnnfuse.__file__).parent


def _layer(module: str) -> int:
    """The layer of `module`: the longest matching prefix of LAYERS."""
    best, level = "", None
    for i, prefixes in enumerate(rnnfuse.LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    if level is None:
        raise AssertionError(f"{module} is on no layer of rnnfuse.LAYERS; add it there")
    return level


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(module: str, path: pathlib.Path):
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                # `from rnnfuse.backends import torch` imports a submodule.
                yield node.lineno, f"{target}.{alias.name}"


def _known(name: str) -> bool:
    parts = name.split(".")
    path = ROOT.parent.joinpath(*parts)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _targets(name: str):
    """`name` and its parent packages below the root, that exist."""
    parts = name.split(".")
    for end in range(2, len(parts) + 1):
        candidate = ".".join(parts[:end])
        if _known(candidate):
            yield candidate


def test_every_module_is_on_a_layer():
    for module, _ in _modules():
        if module != "rnnfuse":
            _layer(module)


def test_no_module_imports_from_a_layer_above_it():
    bad = []
    for module, path in _modules():
        if module == "rnnfuse":
            continue
        own = _layer(module)
        for line, name in _imports(module, path):
            if not name.startswith("rnnfuse"):
                continue
            for target in _targets(name):
                if _layer(target) > own and (module, target) not in rnnfuse.LAYER_EXCEPTIONS:
                    bad.append(
                        f"{path.relative_to(ROOT.parent)}:{line}: {module} "
                        f"(layer {rnnfuse.LAYER_NAMES[own]}) imports {target} "
                        f"(layer {rnnfuse.LAYER_NAMES[_layer(target)]})"
                    )
    assert not bad, "imports against the dependency rule:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("framework", ["tensorflow", "torch", "jax"])
def test_only_backends_import_a_framework(framework):
    """No exceptions: a framework (or Keras' own backend module for it,
    `keras.src.backend.<framework>`) is imported only under backends/."""
    bad = []
    keras_part = f"keras.src.backend.{framework}"
    for module, path in _modules():
        if module.startswith("rnnfuse.backends."):
            continue
        for line, name in _imports(module, path):
            if name == framework or name.startswith((framework + ".", keras_part)):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {name}")
    assert not bad, "\n".join(bad)


def test_only_get_backend_reads_the_keras_backend_name():
    bad = []
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("keras.backend.backend", "backend.backend")
                and module != "rnnfuse.backends"
            ):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not bad, f"keras.backend.backend() read outside get_backend: {bad}"


def test_the_exceptions_are_still_needed():
    """An exception that no import needs any more must be removed."""
    used = set()
    for module, path in _modules():
        for _, name in _imports(module, path):
            for target in _targets(name) if name.startswith("rnnfuse") else ():
                used.add((module, target))
    stale = set(rnnfuse.LAYER_EXCEPTIONS) - used
    assert not stale, f"stale entries in rnnfuse.LAYER_EXCEPTIONS: {sorted(stale)}"


def test_text_is_drawn_in_the_render_modules_only():
    """Records hold data (report.py draws nothing); the report's tables are
    drawn by report_text.py and the commands' output by cli/render.py."""
    allowed = {"rnnfuse.report_text", "rnnfuse.cli.render"}
    drawing = set()
    for module, path in _modules():
        for _, name in _imports(module, path):
            if name.startswith(("rich.console", "rich.table")):
                drawing.add(module)
    assert drawing == allowed
