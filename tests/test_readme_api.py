"""The README's Python API example, run as it stands (so the docs cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

from safetensors.torch import load_file

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- the test runs the python block below -->"


def example() -> str:
    text = README.read_text()
    assert MARKER in text, "the README lost its tested example"
    match = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.DOTALL)
    assert match is not None
    return match.group(1)


def test_readme_python_api_example_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(example(), str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "planned:" in out and "step 2: loss" in out and "step 4: loss" in out
    assert sorted(p.name for p in (tmp_path / "runs/my-run/checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]
    weights = load_file(str(tmp_path / "runs/my-run/model.safetensors"))
    assert "norm.weight" in weights and "tok_emb.weight" in weights
