"""A model family registered from outside mt-train (the toy family of ``toy_family.py``, through
the same ``mt_register_model_families`` hook the built-in Llama uses) trains with mt-train,
logs its extra loss, checkpoints with its family name and reloads."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from train_checks import tiny_overrides

from mt_core import register_builtin_plugin, reset_plugin_manager
from mt_train import Trainer, compose_config, to_train_config
from mt_train.cli import main
from mt_train.hf_checkpoints import load_model
from mt_train.models import family_of, model_families

TOY = {"model": "toy_tiny", "model.width": 32, "model.ffn_dim": 64, "trainer.max_steps": 4}


@pytest.fixture
def toy_registered() -> Iterator[None]:
    register_builtin_plugin("toy_family", "toy_family")
    try:
        yield
    finally:
        reset_plugin_manager()


def _overrides(kjv_data: Path, **extra: object) -> list[str]:
    base = [o for o in tiny_overrides(kjv_data) if not o.startswith("model.")]
    return base + [f"{k}={v}" for k, v in {**TOY, **extra}.items()]


def test_toy_family_is_registered_beside_llama(toy_registered: None) -> None:
    assert {"llama", "toy"} <= set(model_families())
    cfg = to_train_config(compose_config(["model=toy_tiny", "model.width=48"])).model
    assert type(cfg).__name__ == "ToyConfig" and cfg.width == 48
    assert family_of(cfg).name == "toy"


def test_toy_family_bad_key_is_one_line(toy_registered: None, capsys) -> None:
    assert main(["model=toy_tiny", "model.dim=64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.dim" in err, err


def test_toy_family_trains_logs_its_extra_loss_and_reloads(
    toy_registered: None, kjv_data: Path, tmp_path: Path
) -> None:
    cfg = to_train_config(compose_config(_overrides(kjv_data)))
    trainer = Trainer(cfg, output_dir=tmp_path)
    try:
        assert "Toy MLP LM" in trainer.describe() and "2 MLP blocks" in trainer.describe()
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary.steps == 4 and math.isfinite(summary.val_loss)
    assert summary.losses[-1] < summary.losses[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    aux = [row["toy_aux"] for row in rows if row["kind"] == "train"]
    assert aux and all(math.isfinite(a) and a > 0 for a in aux)
    manifest = json.loads((Path(summary.checkpoint) / "manifest.json").read_text())
    assert manifest["model_family"] == "toy" and manifest["model"]["width"] == 32
    reloaded = load_model(summary.checkpoint)
    assert type(reloaded).__name__ == "ToyLM"
    assert sum(p.numel() for p in reloaded.parameters()) == sum(
        p.numel() for p in trainer.module.parameters()
    )


def test_readme_family_example_trains(kjv_data: Path, tmp_path: Path, monkeypatch) -> None:
    readme = Path(__file__).parents[1] / "README.md"
    section = readme.read_text().split("## Adding a model family", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace('"model=mlp_lm_tiny",', f'"model=mlp_lm_tiny", "data.path={kjv_data}",')
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(code, str(readme), "exec", dont_inherit=True), {"__name__": "readme_example"})
    finally:
        reset_plugin_manager()
    assert (tmp_path / "outputs" / "mlp_lm" / "metrics.jsonl").is_file()


def test_toy_family_under_tensor_parallel_layouts_validates(toy_registered: None) -> None:
    # The toy config has no heads: its base check_parallel still divides the vocabulary.
    with pytest.raises(ValueError, match="tensor parallel size tp=3 does not divide vocab_size"):
        to_train_config(compose_config(["model=toy_tiny", "model.vocab_size=320", "parallel.tp=3"]))
