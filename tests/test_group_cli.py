"""A group of SAEs through the real commands: one fit (one TensorBoard run per member, one checkpoint, a
final line per member), resume, export of one member or all, predict of one member, and bad groups as
one ``error:`` line. The numerics of a member against the SAE alone are tests/test_group.py's."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fork_server
import pytest
import torch
import yaml

from sae_pipeline.__main__ import main
from sae_pipeline.artifacts import load_sae
from sae_pipeline.artifacts.checkpoint import read_checkpoint, sae_from_checkpoint
from tests.in_process import QUIET, REPO_DPATH, error_lines, run

MEMBERS = {
    "topk": {"sae": {"class_path": "sae_pipeline.sae.TopKSAE", "init_args": {"d_sae": 96, "k": 4}}, "lr": 2e-3},
    "jump": {
        "sae": {"class_path": "JumpReLUSAE", "init_args": {"d_sae": 80, "initial_threshold": 0.05}},
        "warmup_steps": 2,
        "gradient_clip_val": 0.5,
    },
}
FIGURES = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def write_config(dpath: Path, members: object, name: str = "pair") -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 6, "log_every_n_steps": 2},
        "model": {"members": members},
        "data": {"source": "digits", "batch_size": 256, "num_workers": 0},
    }
    fpath = dpath / f"{name}.yaml"
    fpath.write_text(yaml.safe_dump(config, sort_keys=False))
    return fpath


def in_dir(cwd: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        return run(args, capsys)
    finally:
        os.chdir(previous)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 6-step fit of a two-member group on digits, figures on; (working directory, its stdout)."""
    cwd = tmp_path_factory.mktemp("group")
    config = write_config(cwd, MEMBERS)
    out = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):  # capsys is function-scoped
            assert main(["fit", "--config", str(config), *FIGURES]) == 0
    finally:
        os.chdir(previous)
    return cwd, out.getvalue()


def scalars(dpath: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dpath), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_fit_writes_one_run_per_member_and_one_checkpoint(fitted: tuple[Path, str]) -> None:
    cwd, out = fitted
    version = cwd / "runs" / "pair" / "version_0"
    ckpt = version / "checkpoints" / "last.ckpt"
    for name in MEMBERS:
        assert f"Final checkpoint of {name} (global step 6): runs/pair/version_0/checkpoints/last.ckpt" in out
        tags = scalars(version / name)
        assert len(tags["train/loss"]) == 3  # steps 2, 4, 6 (log_every_n_steps 2)
        assert {"lr", "train/r2", "train/l0", "val/r2", "val/dead_fraction", "val/babel_dict_r1"} <= set(tags)
        assert yaml.safe_load((version / name / "hparams.yaml").read_text())["sae"]["init_args"]["d_in"] == 64
    # each member's own schedule: topk peaks at once (no warm-up given: 1000 capped to 6), jump warms up in 2
    assert scalars(version / "topk")["lr"][0] != scalars(version / "jump")["lr"][0]
    checkpoint = torch.load(ckpt, weights_only=True)
    assert list(checkpoint["sae_group"]) == ["topk", "jump"] and checkpoint["global_step"] == 6
    member = read_checkpoint(ckpt, name="jump", need=("input_scale",))
    sae = sae_from_checkpoint(member)
    assert sae.d_sae == 80 and torch.equal(sae.W_dec, checkpoint["state_dict"]["members.jump.sae.W_dec"])


@pytest.mark.slow
def test_resume_export_and_predict_one_member(
    fitted: tuple[Path, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cwd, _ = fitted
    config = str(cwd / "pair.yaml")
    status, out, err = in_dir(
        cwd, ["fit", "--config", config, "--ckpt_path", "last", "--trainer.max_steps", "8", *QUIET], capsys
    )
    assert status == 0, err[-2000:]
    resumed = cwd / "runs" / "pair" / "version_1" / "checkpoints" / "last.ckpt"
    assert "Final checkpoint of jump (global step 8)" in out and resumed.is_file()

    status, out, err = run(["export", "--ckpt_path", str(resumed), "--out", str(tmp_path / "all")], capsys)
    assert status == 0, err
    status, _, err = run(
        ["export", "--ckpt_path", str(resumed), "--out", str(tmp_path / "one"), "--name", "topk"], capsys
    )
    assert status == 0, err
    one, from_all = load_sae(tmp_path / "one"), load_sae(tmp_path / "all" / "topk")
    assert load_sae(tmp_path / "all" / "jump").d_sae == 80
    x = torch.rand(5, 64)
    assert torch.equal(one(x).x_hat, from_all(x).x_hat)
    state = torch.load(resumed, weights_only=True)["state_dict"]
    assert torch.equal(one.W_dec, state["members.topk.sae.W_dec"])

    codes = tmp_path / "codes.h5"
    args = ["predict", "--ckpt_path", str(resumed), "--data.source", "digits", "--codes.fpath", str(codes), *QUIET]
    status, _, err = run([*args, "--model.predict_member", "jump"], capsys)
    assert status == 0 and codes.is_file(), err[-2000:]
    status, _, err = run([*args[:-6], "--codes.fpath", str(tmp_path / "c2.h5"), *QUIET], capsys)
    assert status == 2 and "--model.predict_member names no member: pass one of topk, jump" in err


def test_bad_groups_are_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    duplicate = tmp_path / "duplicate.yaml"
    text = write_config(tmp_path, MEMBERS).read_text()
    duplicate.write_text(text.replace("  jump:", "  topk:"))
    wrong_d_in = {"a": {"sae": {"class_path": "TopKSAE", "init_args": {"d_in": 12, "d_sae": 32, "k": 2}}}}
    # the full class path: complete init_args that jsonargparse can build an SAE from
    full_path = {
        "a": {"sae": {"class_path": "sae_pipeline.sae.TopKSAE", "init_args": {"d_in": 12, "d_sae": 32, "k": 2}}}
    }
    d_in_line = "model.members.a.sae.init_args.d_in=12 differs from the data's d_in=64; drop d_in from the member"
    cases = [
        (["--config", str(duplicate)], "model.members names 'topk' twice"),
        (["--config", str(write_config(tmp_path, wrong_d_in, "d_in"))], d_in_line),
        (["--config", str(write_config(tmp_path, full_path, "full_path"))], d_in_line),
        (["--config", str(write_config(tmp_path, {}, "empty"))], "model.members is empty"),
        (
            ["--config", str(write_config(tmp_path, MEMBERS)), "--trainer.gradient_clip_val", "1"],
            "--trainer.gradient_clip_val clips the norm of every SAE of a group together",
        ),
    ]
    for args, expected in cases:
        status, _, err = in_dir(tmp_path, ["fit", *args, *QUIET], capsys)
        lines = error_lines(err)
        assert status == 2 and len(lines) == 1 and expected in lines[0], err[-2000:]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.ckpt"))


def test_shipped_group_config_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sae_pipeline.cli import cli_main

    monkeypatch.setattr("sys.argv", ["sae_pipeline"])
    cli = cli_main(["--config", str(REPO_DPATH / "configs" / "group_digits.yaml")], run=False)
    assert cli.group and list(cli.model.members) == ["topk_k10", "mpsae_k10", "relu"]
    assert {member.sae.d_in for member in cli.model.members.values()} == {64}  # from the data
    assert cli.model.clipping["relu"] == (1.0, "norm") and cli.model.clipping["topk_k10"][0] is None


def test_member_flags_merge_into_the_member_and_a_right_d_in_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model.members.NAME.KEY`` sets one setting of the member, as ``--model.lr`` does for one SAE (it
    replaced the whole member: "must hold sae"); ``d_in`` equal to the data's is accepted."""
    from sae_pipeline.cli import cli_main

    monkeypatch.setattr("sys.argv", ["sae_pipeline"])
    members = {name: {**entry, "sae": {**entry["sae"]}} for name, entry in MEMBERS.items()}
    members["topk"]["sae"] = {"class_path": "sae_pipeline.sae.TopKSAE", "init_args": {"d_in": 64, "d_sae": 96, "k": 4}}
    config = str(write_config(tmp_path, members))
    flags = ["--model.members.topk.lr", "0.05", "--model.members.jump.sae.init_args.d_sae=40"]
    cli = cli_main(["--config", config, *flags, "--model.members.jump.gradient_clip_val", "2"], run=False)
    topk, jump = cli.model.members["topk"], cli.model.members["jump"]
    assert (topk.hparams.lr, topk.sae.d_in, topk.sae.d_sae, topk.sae.k) == (0.05, 64, 96, 4)
    assert (jump.sae.d_sae, jump.sae.d_in, jump.hparams.warmup_steps) == (40, 64, 2)  # the rest of the member kept
    assert cli.model.clipping["jump"] == (2, "norm")


def resume_args(cwd: Path, members: object, *flags: str) -> list[str]:
    ckpt = str(cwd / "runs" / "pair" / "version_0" / "checkpoints" / "last.ckpt")
    return ["fit", "--config", str(write_config(cwd, members, "changed")), "--ckpt_path", ckpt, *flags, *QUIET]


def changed(name: str, **change: object) -> dict[str, object]:
    """MEMBERS with one member's entry (or its SAE's init_args, under ``init_args``) changed."""
    members = {key: {**entry, "sae": {**entry["sae"]}} for key, entry in MEMBERS.items()}  # type: ignore[dict-item]
    if "init_args" in change:
        members[name]["sae"]["init_args"] = {**members[name]["sae"]["init_args"], **change.pop("init_args")}
    members[name].update(change)
    return members


RESUME_REFUSED = {
    "k in the config": (
        changed("topk", init_args={"k": 3}),
        [],
        "its member topk holds TopKSAE(d_sae=96, k=4) but the config asks for TopKSAE(d_sae=96, k=3)",
    ),
    "another variant": (
        changed("topk", sae={"class_path": "ReLUSAE", "init_args": {"d_sae": 96}}),
        [],
        "its member topk holds TopKSAE(d_sae=96, k=4) but the config asks for ReLUSAE(d_sae=96)",
    ),
    "lr in the config": (
        changed("topk", lr=0.01),
        [],
        "was trained with model.members.topk.lr=0.002 but the config asks for model.members.topk.lr=0.01",
    ),
    "an lr flag": (
        MEMBERS,
        ["--model.members.topk.lr", "0.1"],
        "model.members.topk.lr=0.002 but the config asks for model.members.topk.lr=0.1",
    ),
    "a clipping flag": (
        MEMBERS,
        ["--model.members.jump.gradient_clip_val", "2"],
        "was trained with "
        "model.members.jump.gradient_clip_val=0.5 but the config asks for model.members.jump.gradient_clip_val=2",
    ),
    "a k flag": (MEMBERS, ["--model.members.topk.sae.init_args.k", "5"], "asks for TopKSAE(d_sae=96, k=5)"),
}


@pytest.mark.parametrize("case", sorted(RESUME_REFUSED))
def test_resuming_a_group_with_a_changed_member_is_refused_in_one_line(
    case: str, fitted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The single-SAE rule (tests/test_resume_config.py) for each member: an explicit disagreement with the
    checkpoint names both values (the checkpoint's members trained on, exit 0)."""
    cwd, _ = fitted
    members, flags, expected = RESUME_REFUSED[case]
    before = sorted(str(path) for path in (cwd / "runs").rglob("*"))
    status, _, err = in_dir(cwd, resume_args(cwd, members, *flags), capsys)
    lines = error_lines(err)
    assert status == 2 and len(lines) == 1 and expected in lines[0], err[-3000:]
    assert "pass the config the run was trained with (its version_N/config.yaml)" in lines[0]
    assert sorted(str(path) for path in (cwd / "runs").rglob("*")) == before  # nothing written


def test_a_member_flag_equal_to_the_checkpoints_is_accepted(
    fitted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    cwd, _ = fitted
    ckpt = str(cwd / "runs" / "pair" / "version_0" / "checkpoints" / "last.ckpt")
    flags = ["--model.members.topk.lr", "2e-3", "--model.members.jump.sae.init_args.d_sae", "80"]
    status, _, err = in_dir(
        cwd, ["validate", "--config", str(cwd / "pair.yaml"), "--ckpt_path", ckpt, *flags, *QUIET], capsys
    )
    assert status == 0, err[-3000:]


def test_a_single_sae_config_with_a_group_checkpoint_is_one_error_line(
    fitted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the config parser's usage and "Parsing of ckpt_path hyperparameters failed!"."""
    cwd, _ = fitted
    ckpt = str(cwd / "runs" / "pair" / "version_0" / "checkpoints" / "last.ckpt")
    before = sorted(str(path) for path in (cwd / "runs").rglob("*"))
    config = str(REPO_DPATH / "configs" / "topk_digits.yaml")
    status, _, err = in_dir(cwd, ["fit", "--config", config, "--ckpt_path", ckpt, *QUIET], capsys)
    lines = error_lines(err)
    assert status == 2 and len(lines) == 1, err[-3000:]
    assert (
        f"--ckpt_path {ckpt} holds a group of 2 SAEs (topk, jump) but the config names one SAE; pass the group's "
        "config (its version_N/config.yaml) or start a new run without --ckpt_path" in lines[0]
    ), lines[0]
    assert "usage:" not in err and "Parsing of ckpt_path" not in err
    assert sorted(str(path) for path in (cwd / "runs").rglob("*")) == before


@pytest.mark.slow
def test_sigterm_to_one_ddp_rank_saves_the_group_and_the_run_resumes(tmp_path: Path) -> None:
    """DDP (2 CPU ranks, gloo): SIGTERM to rank 1 stops both ranks at one step with the group's checkpoint
    (exit 143); ``--ckpt_path last`` then finishes every member at max_steps."""
    from tests.test_interrupts import ENV, child_pids, finish, saved_step

    max_steps = 30
    members = {name: {**entry, "sae": {**entry["sae"]}} for name, entry in MEMBERS.items()}
    members["topk"]["sae"]["init_args"] = {"d_sae": 1500, "k": 4}  # a step of tens of ms: the signal lands mid-run
    config = str(write_config(tmp_path, members))
    args = ["fit", "--config", config, "--trainer.max_steps", str(max_steps), "--trainer.max_epochs", "-1"]
    args += ["--trainer.check_val_every_n_epoch", "1000", "--checkpoint.every_n_train_steps", "2", *QUIET]
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    process = subprocess.Popen(
        [sys.executable, "-m", "sae_pipeline", *args, *ddp],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("runs/pair/version_0/checkpoints/*.ckpt")):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    (rank1,) = child_pids(process.pid)
    os.kill(rank1, signal.SIGTERM)
    status, _, err = finish(process)
    assert status == 143, err[-3000:]
    last = "runs/pair/version_0/checkpoints/last.ckpt"
    step = saved_step(err, "SIGTERM", last)
    assert 2 <= step < max_steps and torch.load(tmp_path / last, weights_only=True)["global_step"] == step

    resumed = fork_server.run(
        [sys.executable, "-m", "sae_pipeline", *args, "--ckpt_path", "last"], cwd=tmp_path, env=ENV, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Final checkpoint of topk (global step {max_steps})" in resumed.stdout
    final = torch.load(tmp_path / "runs/pair/version_1/checkpoints/last.ckpt", weights_only=True)
    adam_steps = {int(state["step"]) for state in final["optimizer_states"][0]["state"].values()}
    assert adam_steps == {max_steps}  # every member's optimiser state continued rather than restarting
