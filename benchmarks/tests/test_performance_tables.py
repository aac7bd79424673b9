"""``benchmarks/performance_tables.py``: the generated tables of ``docs/performance.md`` match the
results in ``docs/data``, and ``--check`` catches a stale table or a section without its source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import performance_tables as pt
import pytest


@pytest.fixture
def copies(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of docs/performance.md and docs/data to break."""
    doc, data = tmp_path / "performance.md", tmp_path / "data"
    shutil.copy(pt.DOC, doc)
    shutil.copytree(pt.DATA, data)
    return doc, data


def test_the_repository_doc_is_current() -> None:
    assert pt.main(["--check"]) == 0


def test_the_seed_table_states_the_merged_results(copies: tuple[Path, Path]) -> None:
    _, data = copies
    result = json.loads((data / pt.SEEDS_FILE).read_text())
    text = pt.quality_seeds(data)
    for recipe, entry in result["paired"].items():
        (row,) = [line for line in text.splitlines() if line.startswith(f"| {recipe} |")]
        assert pt.signed_pct(entry["mean_vs_bf16_pct"]) in row
    assert pt.signed_pct(-0.5876) == "−0.59%" and pt.signed_pct(0.1347) == "+0.13%"


def test_check_finds_a_stale_table_and_rewriting_fixes_it(copies: tuple[Path, Path]) -> None:
    doc, data = copies
    seeds = data / pt.SEEDS_FILE
    result = json.loads(seeds.read_text())
    result["paired"]["rowwise"]["mean_vs_bf16_pct"] = -1.5
    seeds.write_text(json.dumps(result))
    assert any("quality_seeds" in p for p in pt.check(doc, data))
    assert pt.main(["--doc", str(doc), "--data", str(data)]) == 0
    assert pt.check(doc, data) == []
    assert "| rowwise | −1.20% | −0.92% | +0.13% | **−1.50%** |" in doc.read_text()


def test_check_finds_a_section_without_its_commit(copies: tuple[Path, Path]) -> None:
    doc, data = copies
    text = doc.read_text()
    doc.write_text(text.replace("- Commit: 5f7f294\n", "", 1))
    problems = pt.check(doc, data)
    assert problems == ["FP8 and bf16 against torchao: no '- Commit:' line"]
    assert pt.main(["--check", "--doc", str(doc), "--data", str(data)]) == 1


def test_an_unknown_table_name_is_refused(copies: tuple[Path, Path]) -> None:
    doc, data = copies
    doc.write_text("<!-- performance_tables: nope -->\n<!-- /performance_tables -->\n")
    with pytest.raises(KeyError, match="unknown table 'nope'; known: loss_ablation, "):
        pt.check(doc, data)


def test_an_unfinished_pair_is_compared_at_the_last_step_both_reached() -> None:
    runs = {
        "a@1": {"final_step": 1900, "final_val_loss": 1.0, "val_loss": [[100, 2.0], [1900, 1.0]]},
        "b@1": {"final_step": 2000, "final_val_loss": 0.9, "val_loss": [[100, 2.0], [1900, 1.1]]},
    }
    pairs = [("a", "a", "b", "b")]
    (strict,) = pt._paired_rows(runs, 2000, ["1"], pairs)
    assert strict[2] == "—"
    (row,) = pt._paired_rows(runs, 2000, ["1"], pairs, common_step=True)
    assert row[2] == f"1.0000 ({pt.signed_pct(100 * (1.0 / 1.1 - 1))}, step 1,900)"
    assert row[3] == f"**{pt.signed_pct(100 * (1.0 / 1.1 - 1))}**"
