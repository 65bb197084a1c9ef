"""Lightning's private attributes, reached only through ``sae_pipeline.lightning_compat``: each accessor
is run against a real ``Trainer`` and checked for what it means, so a Lightning release that moves
or changes one fails here, by name."""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from sae_pipeline import lightning_compat

REPO_DPATH = Path(__file__).resolve().parents[1]
N_BATCHES = 9


class Probe(L.LightningModule):
    """A linear model that records what the accessors return at each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.update_logs: list[tuple[int, bool]] = []
        self.loader_states: list[bool] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.update_logs.append((self.global_step, lightning_compat.should_update_logs(self.trainer)))
        self.log("stamped", float(lightning_compat.batches_that_stepped(self.trainer)))
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.loader_states.append(lightning_compat.has_train_loader(self.trainer))
        self.trainer.estimated_stepping_batches  # builds the training loader early (see SAEModule)
        self.loader_states.append(lightning_compat.has_train_loader(self.trainer))
        lightning_compat.discard_train_loader(self.trainer)
        self.loader_states.append(lightning_compat.has_train_loader(self.trainer))
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_probe(tmp_path: Path) -> tuple[Probe, L.Trainer, list[dict[str, str]]]:
    module = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, log_every_n_steps=3,
                        logger=CSVLogger(tmp_path, name="probe"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(torch.randn(N_BATCHES * 4, 2), batch_size=4))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("stamped")]
    return module, trainer, rows


def test_logging_accessors_agree_with_what_the_logger_wrote(tmp_path: Path) -> None:
    module, trainer, rows = fit_probe(tmp_path)
    assert trainer.global_step == N_BATCHES  # the discarded early loader was rebuilt: no batch lost
    written_steps = {int(row["step"]) for row in rows}
    flagged_steps = {step for step, update in module.update_logs if update}
    assert flagged_steps == written_steps == {2, 5, 8}  # every 3rd step (log_every_n_steps=3)
    # batches_that_stepped is the step the logger stamps on a value logged at that moment.
    assert all(float(row["stamped"]) == int(row["step"]) for row in rows)


def test_train_loader_accessors_see_the_early_loader(tmp_path: Path) -> None:
    module, _, _ = fit_probe(tmp_path)
    assert module.loader_states == [False, True, False]


def test_hpc_save_path_numbers_past_existing_checkpoints(tmp_path: Path) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert Path(lightning_compat.hpc_save_path(trainer, str(tmp_path))).name == "hpc_ckpt_1.ckpt"
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"")
    (tmp_path / "hpc_ckpt_4.ckpt").write_bytes(b"")
    assert lightning_compat.hpc_save_path(trainer, str(tmp_path)) == str(tmp_path / "hpc_ckpt_5.ckpt")


def test_cluster_environment_is_slurm_under_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert type(lightning_compat.cluster_environment(trainer)) is LightningEnvironment
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "node1"}.items():
        monkeypatch.setenv(name, value)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    environment = lightning_compat.cluster_environment(trainer)
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue


def test_no_private_lightning_attribute_outside_the_compat_module() -> None:
    pattern = re.compile(r"(trainer|fit_loop|epoch_loop|connector)\._[a-z]|_(checkpoint|logger|accelerator)_connector"
                         r"|_batches_that_stepped|_combined_loader|_data_fetcher")
    offenders = [f"{fpath.relative_to(REPO_DPATH)}:{number}"
                 for fpath in sorted((REPO_DPATH / "sae_pipeline").rglob("*.py"))
                 if fpath.name != "lightning_compat.py"
                 for number, line in enumerate(fpath.read_text().splitlines(), 1)
                 if pattern.search(line.split("#")[0])]
    assert offenders == []


def test_pyproject_caps_lightning_at_the_verified_minor() -> None:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    dependencies = tomllib.loads((REPO_DPATH / "pyproject.toml").read_text())["project"]["dependencies"]
    lightning = next(spec for spec in dependencies if re.match(r"lightning\b", spec))
    major, minor = map(int, lightning_compat.VERIFIED_LIGHTNING.split("."))
    assert f"<{major}.{minor + 1}" in lightning.replace(" ", "")
