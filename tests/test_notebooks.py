"""Every notebook in notebooks/ runs top to bottom on the embedded demo model (nbclient), so none
goes stale. Each notebook leaves a dict SUMMARY of what it computed; the test prints it from an
extra cell appended at the end and checks it."""

from __future__ import annotations

import json
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # each notebook starts a kernel and loads the demo model

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "lookm-test-python"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernelspec that starts ipykernel with this interpreter (found first through JUPYTER_PATH).

    The kernels share a persistent XLA compilation cache: the quickstart and the sweep run the
    same programs (full cache and LOOK-M 20% on a one-image prompt of the same bucket), compiled once.
    """
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lookm tests", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(root / "xla_cache"))
        yield KERNEL


def outputs(nb, kind: str) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == kind]


def has_png(nb) -> bool:
    return any("image/png" in o.data for o in outputs(nb, "display_data"))


def check_quickstart(nb, s):
    assert 0 < s["cache_ratio"] < 0.3  # 20% of the prompt (+ the decode slots) vs the whole prompt
    assert s["kept_text"] > s["kept_image"]  # text-prior: text is kept first
    assert s["kept_text"] <= s["prompt_text"]
    assert 0 <= s["identical_tokens"] <= 1
    assert s["answers"]["full"] and s["answers"]["lookm"]


def check_attention(nb, s):
    layers, length = s["shape"]
    assert layers == 30 and length > 64  # SmolLM2's 30 layers; one image is 64 tokens
    assert s["row_sums"] == pytest.approx([length] * layers, rel=1e-4)
    assert s["image_token_share"] == pytest.approx(64 / length)
    assert 0 < s["mean_image_share"] < 1 and s["text_over_image_per_query"] > 0
    assert has_png(nb)


def check_sweep(nb, s):
    rows = s["rows"]
    assert len(rows) == 1 + 2 * 2  # full cache + two methods x two budgets
    full = rows[0]
    # The full cache's answer to the needle is recorded, but not required to be right: with the first,
    # barely trained scene tower (issue 10) the full cache no longer answers it (it did with the old tower).
    assert full["label"] == "full cache" and full["fidelity"] == 1.0 and full["accuracy"] in (0.0, 1.0)
    assert {r["budget"] for r in rows[1:]} == {0.2, 0.5}
    assert all(0 <= r["fidelity"] <= 1 and r["accuracy"] in (0.0, 1.0) for r in rows)
    assert has_png(nb)


CHECKS = {"01_quickstart": check_quickstart, "02_attention_by_modality": check_attention,
          "03_budget_sweep": check_sweep}


def test_every_notebook_is_checked():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_notebook_runs_top_to_bottom(name, kernel, tmp_path):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    nb.cells.append(nbformat.v4.new_code_cell("import json; print(json.dumps(SUMMARY))"))
    NotebookClient(nb, kernel_name=kernel, timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    summary = json.loads(nb.cells[-1].outputs[0].text)
    CHECKS[name](nb, summary)
