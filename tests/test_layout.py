"""The compression core imports no model code: its modules import only each other and the shared
input checks, errors and reductions (so a method can be read, tested and reused without a model)."""

from __future__ import annotations

import ast
import pathlib

import lookm_jax.compression

ALLOWED = ("lookm_jax.compression", "lookm_jax.checks", "lookm_jax.errors", "lookm_jax.reductions")


def imported_modules(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.append(node.module)
    return names


def test_compression_imports_no_model_code():
    root = pathlib.Path(lookm_jax.compression.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 12, files  # the core and its methods were found
    for path in files:
        for name in imported_modules(path):
            if name == "lookm_jax" or name.startswith("lookm_jax."):
                assert name.startswith(ALLOWED), f"{path.relative_to(root)} imports {name}"
