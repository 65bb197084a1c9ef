"""Lightning's private attributes, reached only through ``sae_pipeline.training.lightning_compat``: each accessor
is run against a real ``Trainer`` and checked for what it means, so a Lightning release that moves
or changes one fails here, by name."""

from __future__ import annotations

import csv
import os
import re
import signal
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from sae_pipeline.training import lightning_compat

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
        _ = self.trainer.estimated_stepping_batches  # builds the training loader early (see SAEModule)
        self.loader_states.append(lightning_compat.has_train_loader(self.trainer))
        lightning_compat.discard_train_loader(self.trainer)
        self.loader_states.append(lightning_compat.has_train_loader(self.trainer))
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_probe(tmp_path: Path) -> tuple[Probe, L.Trainer, list[dict[str, str]]]:
    module = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=3,
        logger=CSVLogger(tmp_path, name="probe"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
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
    for name, value in {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "node1",
    }.items():
        monkeypatch.setenv(name, value)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    environment = lightning_compat.cluster_environment(trainer)
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue


def test_no_private_lightning_attribute_outside_the_compat_module() -> None:
    pattern = re.compile(
        r"(trainer|fit_loop|epoch_loop|connector)\._[a-z]|_(checkpoint|logger|accelerator)_connector"
        r"|_batches_that_stepped|_combined_loader|_data_fetcher"
    )
    offenders = [
        f"{fpath.relative_to(REPO_DPATH)}:{number}"
        for fpath in sorted((REPO_DPATH / "sae_pipeline").rglob("*.py"))
        if fpath.name != "lightning_compat.py"
        for number, line in enumerate(fpath.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0])
    ]
    assert offenders == []


def test_pyproject_caps_lightning_at_the_verified_minor() -> None:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    dependencies = tomllib.loads((REPO_DPATH / "pyproject.toml").read_text())["project"]["dependencies"]
    lightning = next(spec for spec in dependencies if re.match(r"lightning\b", spec))
    major, minor = map(int, lightning_compat.VERIFIED_LIGHTNING.split("."))
    assert f"<{major}.{minor + 1}" in lightning.replace(" ", "")


class Sized(L.LightningModule):
    """A module whose one hyper-parameter is visible in its weights' shape."""

    def __init__(self, width: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)


def test_ckpt_path_hook_runs_before_the_cli_reads_the_checkpoint(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    ckpt_fpath = tmp_path / "sized.ckpt"
    torch.save({"hyper_parameters": {"width": 3}, "state_dict": {}}, ckpt_fpath)

    class HookedCLI(lightning_compat.CkptPathHook, LightningCLI):
        def prepare_ckpt_path(self) -> None:
            self.given = self.config.fit.ckpt_path
            self.config.fit.ckpt_path = str(ckpt_fpath)  # e.g. `last` resolved to a file

        def fit(self, **kwargs: object) -> None:  # LightningCLI runs this instead of Trainer.fit
            self.fit_kwargs = kwargs

    cli = HookedCLI(Sized, args=["fit", "--ckpt_path", "last", "--trainer.logger", "false"], save_config_callback=None)
    assert cli.given == "last"
    # LightningCLI read the hyper-parameters from the file the hook chose, after the hook.
    assert cli.model.hparams.width == 3 and cli.model.layer.in_features == 3
    assert cli.fit_kwargs["ckpt_path"] == str(ckpt_fpath)


def test_ckpt_path_hook_merges_the_hyper_parameters_it_read(tmp_path: Path) -> None:
    """A hook that returns the checkpoint's hyper-parameters (read by the product's one reader) has them merged,
    and Lightning does not read the file for them again; a ``_class_path`` naming the CLI's own model is dropped."""
    from lightning.pytorch.cli import LightningCLI

    ckpt_fpath = tmp_path / "sized.ckpt"
    torch.save({"hyper_parameters": {"width": 3}, "state_dict": {}}, ckpt_fpath)  # what Lightning would read

    class HookedCLI(lightning_compat.CkptPathHook, LightningCLI):
        def prepare_ckpt_path(self) -> dict:
            self.config.fit.ckpt_path = str(ckpt_fpath)
            return {
                "width": 5,
                "_instantiator": "lightning.pytorch.cli.instantiate_module",
                "_class_path": f"{Sized.__module__}.{Sized.__qualname__}",
            }

        def fit(self, **kwargs: object) -> None:
            self.fit_kwargs = kwargs

    cli = HookedCLI(Sized, args=["fit", "--ckpt_path", "last", "--trainer.logger", "false"], save_config_callback=None)
    assert cli.model.hparams.width == 5 and cli.model.layer.in_features == 5


class SelfSignalling(Probe):
    """Sends itself SIGTERM during training step 2."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("muted", [False, True])
def test_mute_sigterm_notifier_keeps_lightning_from_acting_on_sigterm(tmp_path: Path, muted: bool) -> None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # what Interrupts installs first
    try:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        if muted:
            lightning_compat.mute_sigterm_notifier(trainer)
            trainer.fit(SelfSignalling(), DataLoader(torch.randn(N_BATCHES * 4, 2), batch_size=4))
            assert trainer.global_step == N_BATCHES and not trainer.received_sigterm
        else:  # the control: Lightning's notifier stops the run with a SystemExit of status None (0)
            with pytest.raises(SIGTERMException):
                trainer.fit(SelfSignalling(), DataLoader(torch.randn(N_BATCHES * 4, 2), batch_size=4))
            assert trainer.global_step == 3
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_checkpoint_accessors_save_last_at_the_current_step(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=4, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Probe(), DataLoader(torch.randn(N_BATCHES * 4, 2), batch_size=4))
    # Lightning's own end-of-training rule left the last periodic step (8) in last.ckpt, not step 9.
    assert lightning_compat.last_saved_step(callback) == 8
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == 8
    lightning_compat.save_last_checkpoint(callback, trainer)
    assert lightning_compat.last_saved_step(callback) == N_BATCHES
    assert callback.last_model_path == str(tmp_path / "ckpts" / "last.ckpt")
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == N_BATCHES


def test_ddp_kwargs_and_comm_hook_are_what_the_strategy_was_given() -> None:
    """The dict itself (a change before the wrap reaches DDP: tests/test_ddp_equality.py reads it back from the
    wrapper of a 2-rank fit) and the hook Lightning would register on CUDA."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    strategy = DDPStrategy(ddp_comm_hook=default_hooks.bf16_compress_hook, gradient_as_bucket_view=False)
    assert lightning_compat.ddp_kwargs(strategy) == {"gradient_as_bucket_view": False}
    assert lightning_compat.ddp_kwargs(strategy) is lightning_compat.ddp_kwargs(strategy)
    assert lightning_compat.ddp_comm_hook(strategy) is default_hooks.bf16_compress_hook
    assert lightning_compat.ddp_comm_hook(DDPStrategy()) is None
