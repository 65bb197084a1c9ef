"""DDP through the real command (2 gloo ranks on the CPU, Lightning's own launcher) equals one process with the
doubled batch, in float64: a TopK SAE (automatic optimisation, AuxK active) and a group of a ReLU SAE and an
MP-SAE (manual optimisation). `--ddp.grad_compression bf16` is really registered: the run stays close to the
exact one but is no longer equal to it. Plus the settings `sae_pipeline.training.ddp` gives DDP.

How the batches match: the shards hold exactly 2·B tokens and one epoch is one step, so the single process's
batch of 2·B is every token, and the two ranks' batches of B are the two halves of the same epoch order
(`sae_pipeline.data.streams`: contiguous token spans per rank). Each epoch repeats the same tokens in a new
order; the loss is a mean over tokens, so only float64 rounding separates the runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import fork_server
import pytest
import torch
import yaml
from lightning.pytorch.strategies import DDPStrategy

from sae_pipeline.training.ddp import DDPSettings
from tests.in_process import QUIET, REPO_DPATH, error_lines, fit_in, run

B = 20  # tokens per rank per step; the single process takes 2·B
STEPS = 4
# 96 latents > 2·B·k = 80 picks per step: some latent is idle in every step, dead after it, so AuxK runs from step 2
TOPK = {"class_path": "TopKSAE", "init_args": {"d_sae": 96, "k": 2, "dead_after_tokens": 2 * B}}
GROUP = {
    "relu": {
        "sae": {"class_path": "ReLUSAE", "init_args": {"d_sae": 40}},
        "lr": 2e-2,
        "warmup_steps": 1,
        "gradient_clip_val": 0.05,
    },
    "mp": {
        "sae": {"class_path": "MatchingPursuitSAE", "init_args": {"d_sae": 32, "k": 3}},
        "lr": 1e-2,
        "warmup_steps": 1,
    },
}
MPSAE_DIGITS = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def write_run(dpath: Path, token_shards: Any, model: dict[str, Any]) -> Path:
    """Shards of 2·B tokens (8 images of 5 tokens, in 2 uneven shards) and a float64 config of STEPS one-step epochs."""
    token_shards(dpath / "shards", [3, 5], 16)
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "precision": "64-true",
            "max_epochs": STEPS,
            "limit_val_batches": 0,
            "log_every_n_steps": 1,
        },
        "model": model,
        "data": {"source": str(dpath / "shards"), "val_fraction": 0.0, "num_workers": 0},
    }
    fpath = dpath / "run.yaml"
    fpath.write_text(yaml.safe_dump(config, sort_keys=False))
    return fpath


def one_process(dpath: Path, config: Path) -> dict[str, torch.Tensor]:
    (dpath / "one").mkdir()
    batch = ["--data.batch_size", str(2 * B), "--data.shuffle_buffer_tokens", str(2 * B)]
    fit_in(dpath / "one", "--config", str(config), "--trainer.devices", "1", *batch)
    return final_state(dpath / "one")


def two_ranks(dpath: Path, config: Path, name: str, *args: str) -> tuple[dict[str, torch.Tensor], str]:
    """A fit over 2 gloo ranks in a subprocess: its final state and its output."""
    cwd = dpath / name
    cwd.mkdir()
    batch = ["--data.batch_size", str(B), "--data.shuffle_buffer_tokens", str(B)]
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    result = fork_server.run(
        [sys.executable, "-m", "sae_pipeline", "fit", "--config", str(config), *batch, *ddp, *args, *QUIET],
        cwd=cwd,
        env=ENV,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "GLOBAL_RANK: 1" in output  # really two processes
    return final_state(cwd), output


def final_state(cwd: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(cwd / "runs" / "run" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == STEPS
    adam = {
        f"adam.{index}.{key}": value
        for index, state in checkpoint["optimizer_states"][0]["state"].items()
        for key, value in state.items()
    }
    return {**checkpoint["state_dict"], **adam}


def assert_equal_runs(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> None:
    """Equal up to float64 rounding, which Adam amplifies where a gradient is itself rounding noise (~1e-17, e.g.
    `W_dec`'s after the component along its atom is removed): its update lr · g / (|g| + 1e-8) changes by up to
    lr / 1e-8 = 1e6 times the gradient's difference, and later steps carry it on (MP-SAE: 7.5e-9 after 4 steps).
    A step that lost a rank's half moves weights by ~lr = 1e-2; one that summed the halves instead of averaging
    them shows in Adam's moments (twice `exp_avg`), not in its steps, which do not see the gradient's scale."""
    assert one.keys() == two.keys()
    for name, value in one.items():
        if not value.is_floating_point():
            assert torch.equal(two[name], value), name  # the dead-latent clock (counted over both ranks)
            continue
        assert value.dtype == torch.float64 or name.endswith(".step"), name
        # squared gradients (~1e-6 and below): to 1e-6 of the tensor's largest (a noise-level gradient's square
        # differs by ~1e-12 of it)
        atol = 1e-6 * float(value.abs().max()) if name.endswith("exp_avg_sq") else 1e-7
        worst = float((two[name] - value).abs().max())
        torch.testing.assert_close(two[name], value, rtol=0.0, atol=atol, msg=f"{name}: differs by up to {worst:.3g}")


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_the_doubled_batch_topk(tmp_path: Path, token_shards: Any) -> None:
    config = write_run(tmp_path, token_shards, {"sae": TOPK, "lr": 1e-2, "warmup_steps": 1})
    one = one_process(tmp_path, config)
    two, output = two_ranks(tmp_path, config, "two")
    assert_equal_runs(one, two)
    assert int((one["sae.tokens_since_fired"] >= 2 * B).sum()) >= 96 - 2 * B * 2  # dead latents: AuxK ran
    assert "uncompressed, in buckets overlapping the backward, gradients as bucket views" in output

    # bf16 compression: registered (the line is printed after DDP took the hook), close to exact, not equal
    compressed, output = two_ranks(tmp_path, config, "bf16", "--ddp.grad_compression", "bf16")
    assert "all-reduced per step, bf16 (--ddp.grad_compression)" in output
    weights = [name for name in one if name.startswith("sae.W_")]
    assert len(weights) == 2
    for name in weights:
        difference = (compressed[name] - one[name]).abs()
        assert difference.max() > 1e-6, name  # rounded gradients: float64 runs that agree to 1e-7 otherwise
        # Adam takes steps of about lr = 1e-2 whatever the gradient's size, so a gradient that nearly cancels
        # over the ranks can change sign once rounded and move its weight by ~2e-2; the typical weight moves
        # by far less. A hook that lost or garbled the gradients would move typical weights by ~lr.
        assert difference.median() < 1e-4, name
        assert difference.norm() < 1e-2 * one[name].norm(), name
    for name in [name for name in one if name.endswith(".exp_avg")]:  # the gradients' scale: averaged over ranks
        assert (compressed[name] - one[name]).norm() < 1e-2 * one[name].norm(), name


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_the_doubled_batch_group(tmp_path: Path, token_shards: Any) -> None:
    """A group (ReLU + MP-SAE) runs manual optimisation: Lightning prepares DDP's reducer before `manual_backward`."""
    config = write_run(tmp_path, token_shards, {"members": GROUP})
    one = one_process(tmp_path, config)
    two, _ = two_ranks(tmp_path, config, "two")
    assert_equal_runs(one, two)


class FakeTrainer:
    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy


def test_settings_default_to_bucket_views_unless_the_strategy_says_otherwise() -> None:
    default, explicit = DDPStrategy(), DDPStrategy(gradient_as_bucket_view=False, bucket_cap_mb=50)
    for strategy in (default, explicit):
        DDPSettings().setup(FakeTrainer(strategy), None, "fit")
    from sae_pipeline.training import lightning_compat

    assert lightning_compat.ddp_kwargs(default) == {"gradient_as_bucket_view": True}
    assert lightning_compat.ddp_kwargs(explicit) == {"gradient_as_bucket_view": False, "bucket_cap_mb": 50}
    for strategy in ("auto", "single_device"):  # nothing to change outside DDP
        DDPSettings(grad_compression="bf16").setup(FakeTrainer(strategy), None, "fit")


def test_compression_beside_another_comm_hook_is_one_line() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    DDPSettings().setup(FakeTrainer(strategy), None, "fit")  # no compression asked: the strategy's hook stays
    with pytest.raises(ValueError, match=r"^--ddp.grad_compression bf16: the strategy already has a ddp_comm_hook"):
        DDPSettings(grad_compression="bf16").setup(FakeTrainer(strategy), None, "fit")


def test_unknown_compression_is_a_parse_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["sae_pipeline"])
    status, _, err = run(["fit", "--config", MPSAE_DIGITS, "--ddp.grad_compression", "int8"], capsys)
    assert status == 2 and any("grad_compression" in line for line in error_lines(err)), err
