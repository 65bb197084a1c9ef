"""The study trains runs that share data and steps as one group; each run's export and logged numbers equal
those of the same run trained alone (``--group_runs false``), and a finished group is reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sae_pipeline.evaluate.run_training import ensure_runs, run_cost, work_units
from sae_pipeline.evaluate.runs import log_dpath, plan_runs
from sae_pipeline.evaluate.studies import logged_metrics

REPO_DPATH = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_grouped_runs_equal_the_runs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["sae_pipeline"])
    specs = plan_runs(["mpsae", "relu"], [(4, 32), (8, 48)], "digits", 6, REPO_DPATH / "configs", "digits")
    grouped, alone = tmp_path / "grouped", tmp_path / "alone"
    assert ensure_runs(specs, grouped) == specs and ensure_runs(specs, alone, group=False) == specs
    (group,) = [p.name for p in (grouped / "runs").iterdir()]  # one group: one pass over the data
    assert group.startswith("group_") and sorted(p.name for p in (alone / "runs").iterdir()) == sorted(
        spec.name for spec in specs
    )
    for spec in specs:
        together = load_file(grouped / "models" / spec.name / "sae.safetensors")
        apart = load_file(alone / "models" / spec.name / "sae.safetensors")
        assert together.keys() == apart.keys()
        for key in apart:
            assert torch.equal(together[key], apart[key]), f"{spec.name}: {key}"
        assert log_dpath(spec, grouped).parent.parent.name == group
        assert logged_metrics(spec, grouped) == logged_metrics(spec, alone)
        assert logged_metrics(spec, grouped)["val/r2"]["step"] == 5

    mtimes = {p: p.stat().st_mtime_ns for p in (grouped / "models").rglob("*")}
    assert ensure_runs(specs, grouped) == []  # finished: reused, not retrained
    assert {p: p.stat().st_mtime_ns for p in (grouped / "models").rglob("*")} == mtimes
    record = json.loads((grouped / "models" / specs[0].name / "study_run.json").read_text())
    assert record["group"] == group and record["settings"] == specs[0].settings()

    # A group whose exports are gone (an interruption before them) continues from its checkpoint, not from scratch.
    for spec in specs:
        (grouped / "models" / spec.name / "study_run.json").unlink()
    assert ensure_runs(specs, grouped) == specs
    record = json.loads((grouped / "models" / specs[0].name / "study_run.json").read_text())
    assert f"--ckpt_path {grouped / 'runs' / group / 'checkpoints' / 'last.ckpt'}" in record["command"]
    assert sorted(p.name for p in (grouped / "runs" / group).glob("version_*")) == ["version_0"]
    assert logged_metrics(specs[0], grouped) == logged_metrics(specs[0], alone)

    # A study folder is an artifact: a group.yaml edited to name a module (a callback planted beside it,
    # importable from the folder the user runs in) is refused on resume, nothing imported or trained.
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "evilmod.py").write_text(f"from pathlib import Path\nPath({str(plant / 'IMPORTED')!r}).touch()\n")
    monkeypatch.syspath_prepend(str(plant))
    config_fpath = grouped / "runs" / group / "group.yaml"
    config = yaml.safe_load(config_fpath.read_text())
    config.setdefault("trainer", {})["callbacks"] = [{"class_path": "evilmod.Evil"}]
    config_fpath.write_text(yaml.safe_dump(config, sort_keys=False))
    for spec in specs:
        (grouped / "models" / spec.name / "study_run.json").unlink()
    ckpt_bytes = (grouped / "runs" / group / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(ValueError, match=r"group\.yaml: not the config this study writes"):
        ensure_runs(specs, grouped)
    assert not (plant / "IMPORTED").exists()
    assert (grouped / "runs" / group / "checkpoints" / "last.ckpt").read_bytes() == ckpt_bytes


def test_a_grid_that_shares_its_data_is_split_until_every_job_has_a_group() -> None:
    points = [(k, 1000) for k in (5, 10, 20, 40)] + [(10, p) for p in (500, 2000)]  # the MNIST grid's points
    specs = plan_runs(["mpsae", "relu", "topk"], points, "digits", 6, REPO_DPATH / "configs", "digits")
    assert len({spec.shared() for spec in specs}) == 1  # the whole grid could be one group
    assert work_units(specs, group=True, jobs=1) == [specs]
    halves = work_units(specs, group=True, jobs=2)
    assert sorted(spec.name for half in halves for spec in half) == sorted(spec.name for spec in specs)
    for variant in ("mpsae", "relu", "topk"):  # each half: half of every variant, one of its two costliest runs
        counts = [sum(spec.variant == variant for spec in half) for half in halves]
        assert counts == [3, 3], (variant, counts)
        for half in halves:
            costs = sorted((run_cost(spec) for spec in half if spec.variant == variant), reverse=True)
            assert costs[0] >= 20_000, (variant, costs)  # k 40 (40 000) or k 20 / p 2000 (20 000)
    totals = [sum(map(run_cost, half)) for half in halves]
    assert abs(totals[0] - totals[1]) <= max(map(run_cost, specs)) / 2, totals
    parts = work_units(specs, group=True, jobs=5)
    assert len(parts) == 5 and sorted(spec.name for part in parts for spec in part) == sorted(s.name for s in specs)
    assert sorted(len(unit) for unit in work_units(specs[:3], group=True, jobs=8)) == [1, 1, 1]
    assert work_units(specs, group=False, jobs=2) == [[spec] for spec in specs]
