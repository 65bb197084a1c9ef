"""The evaluation suite end to end on digits (tiny p, a few steps), through the real training CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import fork_server
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sae_pipeline.artifacts import load_sae
from sae_pipeline.evaluate.__main__ import main
from sae_pipeline.evaluate.runs import is_finished, plan_runs, sparsity_args
from sae_pipeline.evaluate.studies import datamodule_for, load_tokens
from sae_pipeline.sae import SAE_REGISTRY, display_label

REPO_DPATH = Path(__file__).resolve().parents[1]

# p 16 and 24 (p_main 16): the study's atom grids show min(25, p) atoms, so a smaller p draws fewer of them
TINY = [
    "--k",
    "4",
    "8",
    "--k_main",
    "4",
    "--p",
    "16",
    "24",
    "--p_main",
    "16",
    "--max_steps",
    "20",
    "--k_infer",
    "1",
    "2",
    "4",
    "8",
    "16",
    "32",
    "--r_max",
    "8",
]
SEEDS = ["--sae_seeds", "2"]  # the fixture's replicas: seed 0 and 1 of each run, trained in the same group fit


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_DPATH)  # configs/ is found from the working directory


def without_training_figures(patch: pytest.MonkeyPatch) -> None:
    """The fit's own TensorBoard figures (``SAEFigures``, drawn for every member at its validation) off: they cost
    most of a tiny study's training and no assertion here reads them. The study's figures stay; ``SAEFigures`` in a
    group of every variant is drawn in :func:`test_concepts_cover_every_variant` (and in tests/test_group_cli.py)."""
    from sae_pipeline.training.callbacks import SAEFigures

    patch.setattr(SAEFigures, "on_validation_epoch_end", lambda self, trainer, pl_module: None)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory):
    """Every study over MP-SAE and TopK: 6 settings (k in {4, 8} at p = 16, p = 24 at k = 4), 2 SAE seeds each."""
    out = tmp_path_factory.mktemp("study")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_DPATH)
        without_training_figures(patch)
        assert main(["all", "--data", "digits", "--out", str(out), "--variants", "mpsae", "topk", *TINY, *SEEDS]) == 0
    return out


def logged_scalar(run_dpath, tag: str) -> float:
    accumulator = EventAccumulator(str(run_dpath), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator.Scalars(tag)[-1].value


@pytest.mark.slow
def test_all_studies_write_their_files(study) -> None:
    results = json.loads((study / "results.json").read_text())
    assert {"runs", "expressivity", "inference", "coherence", "concepts", "claims", "meta"} <= results.keys()
    assert sorted(results["runs"]) == sorted(  # seed 0 keeps the name it had before SAE seeds; seed 1 is _s1
        f"{v}_p{p}_k{k}{s}" for v in ("mpsae", "topk") for k, p in [(4, 16), (8, 16), (4, 24)] for s in ("", "_s1")
    )
    assert {"mpsae", "topk"} <= set(results["seeds"]["stability"]["variants"])
    assert "## Across SAE seeds (2 per variant and setting)" in (study / "report.md").read_text()
    assert [row["p"] for row in results["expressivity"]["vs_p"]["mpsae"]] == [16, 24]
    assert [row["k"] for row in results["expressivity"]["vs_k"]["topk"]] == [4, 8]
    names = {p.stem for p in (study / "figures").glob("*.png")}
    assert {
        "expressivity_vs_k",
        "expressivity_vs_p",
        "inference_r2_vs_k",
        "babel",
        "frequency_vs_mean",
        "selection_step_vs_mean",
        "sequential_reconstruction",
        "atoms_mpsae_by_frequency",
        "atoms_topk_by_mean",
    } <= names
    report = (study / "report.md").read_text()
    assert all(f"(figures/{name}.png)" in report for name in names)
    assert "## The paper's claims on this data" in report
    accumulator = EventAccumulator(str(study / "tensorboard"), size_guidance={"images": 0})
    accumulator.Reload()
    assert {f"evaluate/{name}" for name in names} <= set(accumulator.Tags()["images"])


@pytest.mark.slow
def test_results_agree_with_what_training_logged(study) -> None:
    results = json.loads((study / "results.json").read_text())
    for name, entry in results["runs"].items():
        record = json.loads((study / "models" / name / "study_run.json").read_text())
        run_dpath = Path(record["log_dpath"])  # the runs share data and steps: one group, a TensorBoard run each
        assert record["group"] and run_dpath.parent.parent.name == record["group"]
        assert entry["r2"] == pytest.approx(logged_scalar(run_dpath, "val/r2"), abs=1e-5)
        assert entry["l0"] == pytest.approx(logged_scalar(run_dpath, "val/l0"), abs=1e-5)
        assert entry["logged"]["val/r2"]["step"] == 19  # validated once, after the last (20th) step


@pytest.mark.slow
def test_numbers_match_plain_references(study) -> None:
    results = json.loads((study / "results.json").read_text())
    spec = plan_runs(["mpsae"], [(4, 16)], "digits", 20, REPO_DPATH / "configs", "digits")[0]
    sae = load_sae(study / "models" / spec.name)
    x = load_tokens(datamodule_for(spec), "val").double()
    with torch.no_grad():
        x_hat = sae(x.float()).x_hat.double()
    r2 = 1 - ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    entry = results["runs"][spec.name]
    assert entry["r2"] == pytest.approx(float(r2), abs=1e-6)
    W = sae.W_dec.detach().double().numpy()
    gram = np.abs(W @ W.T)
    np.fill_diagonal(gram, -np.inf)
    plain = np.cumsum(-np.sort(-gram, axis=1)[:, :8], axis=1).max(axis=0)
    np.testing.assert_allclose(entry["babel_dict"], plain, rtol=1e-5)
    # Proposition 2: MP's residual never grows, so R² cannot fall as the inference k rises.
    for sweep in results["inference"]["by_train_k"]["mpsae"].values():
        assert all(b >= a - 1e-6 for a, b in zip(sweep["r2"], sweep["r2"][1:]))
    assert 4 in results["inference"]["main"]["topk"]["ks"]  # the trained k is always in the sweep


@pytest.mark.slow
def test_rerun_reuses_finished_runs(study) -> None:
    """A study the fixture did not run (probing) over its runs: nothing retrained, earlier studies kept."""
    exports = sorted((study / "models").glob("*/sae.safetensors"))
    mtimes = {p: p.stat().st_mtime_ns for p in exports}
    before = json.loads((study / "results.json").read_text())["runs"]
    args = [
        "--data",
        "digits",
        "--out",
        str(study),
        "--variants",
        "mpsae",
        "topk",
        *TINY,
        *SEEDS,
        "--probe_k",
        "1",
        "4",
    ]
    assert main(["probing", *args, "--seeds", "2"]) == 0
    assert {p: p.stat().st_mtime_ns for p in exports} == mtimes
    assert not list((study / "runs").glob("*/version_1"))
    after = json.loads((study / "results.json").read_text())
    assert after["runs"]["topk_p16_k4"]["r2"] == before["topk_p16_k4"]["r2"]
    assert "expressivity" in after and "probing" in after["meta"]["studies"]  # earlier studies are kept
    assert (study / "figures" / "probing_accuracy_vs_k.png").is_file()
    (study / "report.md").unlink()
    assert main(["report", "--out", str(study)]) == 0
    report = (study / "report.md").read_text()
    assert "## Coherence" in report and "## Sparse probing" in report
    check_probing_by_hand(study, after["probing"], after["runs"])


def check_probing_by_hand(study: Path, probing: dict, runs: dict) -> None:
    """One task redone by hand: class 3 against the rest on the codes TopK computes, plain selection, sklearn."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    from sae_pipeline.evaluate.probing import balanced_tasks

    assert sorted(probing["variants"]) == ["mpsae", "topk"] and probing["ks"] == [1, 4]
    assert (probing["n_train_rows"], probing["n_val_rows"]) == (1617, 180)
    spec = plan_runs(["topk"], [(4, 16)], "digits", 20, REPO_DPATH / "configs", "digits")[0]
    entry = probing["variants"]["topk"]
    assert entry["run"] == spec.name and entry["sae_seeds"][0]["r2_val"] == pytest.approx(
        runs[spec.name]["r2"], abs=1e-6
    )
    check_probing_over_seeds(probing)
    datamodule, labels = datamodule_for(spec), load_digits().target
    sae = load_sae(study / "models" / spec.name)
    codes, targets = {}, {}
    for split in ("train", "val"):
        rows = np.sort(datamodule.data_source.split_rows(split, datamodule.val_fraction))
        with torch.no_grad():
            z = sae.encode(load_tokens(datamodule, split)).numpy()
        task_rows, targets[split] = balanced_tasks(labels[rows])[3]
        codes[split] = z[task_rows]
    y = targets["train"]
    difference = np.abs(codes["train"][y == 1].mean(0) - codes["train"][y == 0].mean(0))
    chosen = np.argsort(-difference, kind="stable")[:4]
    probe = LogisticRegression(max_iter=1000).fit(codes["train"][:, chosen], y)
    plain = np.mean(probe.predict(codes["val"][:, chosen]) == targets["val"])
    assert entry["by_draw"][0]["by_label"]["3"]["4"] == pytest.approx(plain, abs=1e-12)  # the first draw
    assert 0.5 < probing["raw"]["mean"]["all"] <= 1


def check_probing_over_seeds(probing: dict) -> None:
    """A variant's figure is the mean over its SAE seeds; variants are compared by Welch over those seeds."""
    from scipy import stats

    assert probing["sae_seeds"] == 2 and probing["draws"] == 2
    topk, mpsae = probing["variants"]["topk"], probing["variants"]["mpsae"]
    assert [r["run"] for r in topk["sae_seeds"]] == ["topk_p16_k4", "topk_p16_k4_s1"]
    per_seed = {v: [r["mean"]["1"] for r in e["sae_seeds"]] for v, e in (("topk", topk), ("mpsae", mpsae))}
    assert topk["mean"]["1"] == pytest.approx(np.mean(per_seed["topk"]))
    (found,) = [c for c in probing["comparisons"] if c["key"] == "1"]
    assert found["test"] == "welch over SAE seeds" and found["a"] == "mpsae"
    assert found["p"] == pytest.approx(stats.ttest_ind(per_seed["mpsae"], per_seed["topk"], equal_var=False).pvalue)


def test_changed_settings_are_not_finished(tmp_path) -> None:
    spec = plan_runs(["topk"], [(4, 32)], "digits", 20, REPO_DPATH / "configs", "digits")[0]
    model_dpath = tmp_path / "models" / spec.name
    model_dpath.mkdir(parents=True)
    from sae_pipeline.artifacts.export_files import write_export_files

    write_export_files(
        model_dpath, "sae.safetensors", {"w": torch.zeros(2)}, None, "config.json", {}, record_sha256=True
    )
    (model_dpath / "study_run.json").write_text(json.dumps({"settings": spec.settings()}))
    assert is_finished(spec, tmp_path)
    (model_dpath / "sae.safetensors").write_bytes(b"")  # damaged since: trained again
    assert not is_finished(spec, tmp_path)
    write_export_files(
        model_dpath, "sae.safetensors", {"w": torch.zeros(2)}, None, "config.json", {}, record_sha256=True
    )
    longer = plan_runs(["topk"], [(4, 32)], "digits", 40, REPO_DPATH / "configs", "digits")[0]
    assert not is_finished(longer, tmp_path)


@pytest.mark.slow
def test_concepts_cover_every_variant(study, tmp_path) -> None:
    """The concepts study over every registered variant (a copy of the study: its MP-SAE and TopK runs at k_main,
    p_main are reused, the others trained as one group with the training figures on)."""
    out = tmp_path / "every"
    shutil.copytree(study, out)
    assert main(["concepts", "--data", "digits", "--out", str(out), *TINY, "--sae_seeds", "1"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["concepts"]["variants"]) == sorted(SAE_REGISTRY)
    reused = {"mpsae_p16_k4", "topk_p16_k4"}
    for variant, stats in results["concepts"]["variants"].items():
        assert (out / "figures" / f"atoms_{variant}_by_frequency.png").is_file()
        assert (out / "figures" / f"atoms_{variant}_by_mean.png").is_file()
        assert len(stats["frequency"]) == 16 and stats["n_tokens"] == 1797  # p atoms; the whole digits set
        run = results["runs"][stats["run"]]
        record = json.loads((out / "models" / stats["run"] / "study_run.json").read_text())
        assert run["r2"] == pytest.approx(logged_scalar(record["log_dpath"], "val/r2"), abs=1e-5)  # its group member
        assert (Path(record["log_dpath"]).is_relative_to(study)) == (stats["run"] in reused)  # reused, not retrained
    assert results["concepts"]["variants"]["relu"]["sequence"]["order"]  # ReLU's active atoms, by value


def test_variants_labels_and_sparsity_flags_come_from_the_registry() -> None:
    from sae_pipeline.sae import ReLUSAE

    assert {"relu", "jumprelu", "topk", "batchtopk", "mpsae"} <= set(SAE_REGISTRY)
    assert display_label("mpsae") == "MP-SAE" and display_label("relu") == ReLUSAE.label == "ReLU"
    assert sparsity_args("mpsae", 8) == ["--model.sae.init_args.k", "8"]
    assert sparsity_args("jumprelu", 8) == ["--model.sae.init_args.target_l0", "8"]
    assert sparsity_args("relu", 10, "mnist_sample") == ["--model.sae.init_args.l1_coefficient", "0.0085"]
    assert sparsity_args("relu", 20) == ["--model.sae.init_args.l1_coefficient", str(ReLUSAE.l1_for_k(20))]
    with pytest.raises(ValueError, match="unknown variant 'mp'"):  # an alias is no study name: one per variant
        sparsity_args("mp", 8)


def test_parser_stays_light() -> None:
    """--help and flag errors must not wait for torch: the registry is read only once the flags parsed."""
    code = (
        "import sys; import sae_pipeline.evaluate.__main__; from sae_pipeline.evaluate.parser import build_parser; "
        "build_parser().parse_args(['all', '--out', 'x', '--variants', 'mpsae']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_DPATH, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--variants", "mpsae", "gated"], "unknown variant 'gated' in --variants"),
        (["--k", "64", "--p", "32", "--p_main", "32"], "--k 64 exceeds the dictionary size p = 32"),
        (["--data", "/no/such/shards"], "--data /no/such/shards: not found"),
        (["--config_dir", "/no/such/configs"], "--config_dir /no/such/configs: not a directory"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, expected) -> None:
    out = tmp_path / "out"
    assert main(["all", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and "\n" not in err
    assert not out.exists()


def test_unparsable_k_exits_2_with_one_line(tmp_path) -> None:
    completed = fork_server.run(
        [sys.executable, "-m", "sae_pipeline.evaluate", "inference", "--out", str(tmp_path / "out"), "--k", "0"],
        cwd=REPO_DPATH,
    )
    assert completed.returncode == 2
    assert completed.stderr.strip().count("\n") == 0 and "--k" in completed.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_study_on_a_shard_directory_with_user_configs(tmp_path, token_shards) -> None:
    shards = tmp_path / "shards"
    written = token_shards(shards, [4] * 5, 8)
    configs = tmp_path / "configs"
    configs.mkdir()
    for variant, class_name in (("mpsae", "MatchingPursuitSAE"), ("topk", "TopKSAE")):
        (configs / f"{variant}_tiny.yaml").write_text(
            "seed_everything: 0\ntrainer: {accelerator: cpu, devices: 1, max_epochs: 3, log_every_n_steps: 1}\n"
            f"model: {{sae: {{class_path: sae_pipeline.sae.{class_name}, init_args: {{d_sae: 16, k: 2}}}}, "
            "warmup_steps: 2}\ndata: {source: x, batch_size: 8, num_workers: 0, shuffle_buffer_tokens: 16, "
            "val_fraction: 0.2}\n"
        )
    out = tmp_path / "out"
    args = [
        "coherence",
        "--data",
        str(shards),
        "--out",
        str(out),
        "--config_dir",
        str(configs),
        "--variants",
        "mpsae",
        "topk",
        "--k",
        "2",
        "--k_main",
        "2",
        "--p",
        "16",
        "--p_main",
        "16",
        "--r_max",
        "4",
        "--sae_seeds",
        "1",
    ]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    for name in ("mpsae_p16_k2", "topk_p16_k2"):  # the configs' own 3 epochs (no --max_steps)
        entry = results["runs"][name]
        assert entry["n_eval_tokens"] == 20  # the one held-out shard: 4 images x 5 tokens
        record = json.loads((out / "models" / name / "study_run.json").read_text())  # trained as one group
        assert entry["r2"] == pytest.approx(logged_scalar(record["log_dpath"], "val/r2"), abs=1e-5)
    assert (out / "figures" / "babel.png").is_file() and "Coherence" in (out / "report.md").read_text()
    # probing over the same runs: the shards' meta.json labels (the image's index in its shard), tokens mean-pooled
    assert main(["probing", *args[1:], "--probe_k", "1", "2", "--seeds", "2"]) == 0
    probing = json.loads((out / "results.json").read_text())["probing"]
    assert (probing["n_train_rows"], probing["n_val_rows"], probing["tokens_per_image"]) == (16, 4, 5)
    assert probing["labels"] == [0, 1, 2, 3] and sorted(probing["variants"]) == ["mpsae", "topk"]
    assert probing["task_rows"]["val"] == {"0": 2, "1": 2, "2": 2, "3": 2}  # one image per class held out
    from sklearn.linear_model import LogisticRegression

    from sae_pipeline.evaluate.probing import balanced_tasks

    images = {  # the held-out shard is the middle one of five
        split: [(t.astype(np.float32).mean(0), m["label"]) for i in shards_of for _, t, m in written[i]]
        for split, shards_of in (("train", (0, 1, 3, 4)), ("val", (2,)))
    }
    pooled = {split: np.stack([x for x, _ in found]) for split, found in images.items()}
    tasks = {split: balanced_tasks(np.array([c for _, c in found]))[0] for split, found in images.items()}
    (rows, y), (val_rows, val_y) = tasks["train"], tasks["val"]
    probe = LogisticRegression(max_iter=1000).fit(pooled["train"][rows], y)
    plain = np.mean(probe.predict(pooled["val"][val_rows]) == val_y)
    assert probing["raw"]["by_draw"][0]["by_label"]["0"]["all"] == pytest.approx(plain, abs=1e-12)
