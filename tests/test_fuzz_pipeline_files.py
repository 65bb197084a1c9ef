"""Every file the training side reads, fuzzed: a malformed one is one `error:` line naming it, exit 2.

Each reader gets a valid file produced once by the real code (a tiny study: its `results.json`, each run's
export, `study_run.json` and checkpoint; a SAELens export, a codes file, a feature browser site, the paper's
dictionary `.npz`, the repo's configs), then Hypothesis mutates it with the structure in mind: one field given a
wrong type, nested 50 000 deep, a number too large for a float, control characters and a bidi override, deleted;
or the file cut short. The reader runs through its command (`evaluate report`, `export`) or the function behind
one, under the commands' one error path (`feature_extraction.exit_status`), and must either accept the file (the
mutation left it valid) or refuse it with exit 2 and exactly one `error:` line naming the file: no traceback, no
raw control character from the file in the output. A forged size (`d_sae` of 10^12, a codes file declaring 10^12
tokens) is refused before anything of that size is allocated. Each test can fail: it also counts the refusals,
and every reader must refuse some of its mutations.

`EXAMPLES` per reader in the suite; `pytest -m slow` runs `SLOW_EXAMPLES`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import yaml
from fuzz_common import DELETE, RAW_CONTROL, fuzzed, mutated, paths
from fuzz_common import json_bytes as common_json_bytes
from fuzz_common import json_mutations as common_json_mutations
from hypothesis import given
from hypothesis import strategies as st

from feature_extraction.exit_status import run_command

REPO_DPATH = Path(__file__).resolve().parents[1]
EXAMPLES = 25
SLOW_EXAMPLES = 100
COUNTS = [EXAMPLES, pytest.param(SLOW_EXAMPLES, marks=pytest.mark.slow, id="slow")]
CONTROL = "\x1b[2J\x07\x08\u202e\x00"  # clear screen, bell, backspace, right-to-left override, NUL
#: What a field may be replaced by: every JSON kind, the empty ones, huge and tiny numbers, control characters.
WRONG = [None, True, 0, -1, 2**64, 1e300, -1e300, "", CONTROL, "x" * 5000, [], {}, [CONTROL], {CONTROL: 1}, [[[1]]]]
#: Text spliced in for a field, which `json.dumps` would not write: deep nesting, numbers too large, NaN.
RAW = {
    "deep list": "[" * 50_000 + "]" * 50_000,
    "deep object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "huge integer": "9" * 5000,
    "huge float": "1e999",
    "nan": "NaN",
}
WHOLE = [b"", b"null", b"[]", b"7", b'"x"', b"\xff\xfe\x00\x01", RAW["deep list"].encode()]


# -- the outcome ------------------------------------------------------------------------------------------------


class Outcomes:
    """Per reader: how many mutations were refused (exit 2) and accepted (0)."""

    def __init__(self) -> None:
        self.refused = self.accepted = 0

    def check(self, status: int, out: str, err: str, fpath: Path) -> None:
        """Accepted, or refused with one `error:` line naming ``fpath``; no traceback, no raw control character."""
        assert "Traceback" not in err, err[-3000:]
        assert not RAW_CONTROL.search(out + err), repr((out + err)[-2000:])
        if status == 0:
            self.accepted += 1
            return
        assert status == 2, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, err[-3000:]
        assert str(fpath) in errors[0] or (str(fpath.parent) in errors[0] and fpath.name in errors[0]), errors[0]
        assert len(errors[0]) < 2000, errors[0][:300]
        self.refused += 1

    def done(self) -> None:
        assert self.refused, "no mutation was refused: the fuzz did not reach the reader"


def captured(function: Callable[[], Any]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``function`` run as every command runs (`exit_status.run_command`)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status, _ = run_command(function, interrupted="")
    return status, out.getvalue(), err.getvalue()


def command(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command's ``main(argv)`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
    return status, out.getvalue(), err.getvalue()


# -- mutations ---------------------------------------------------------------------------------------------------


def json_bytes(doc: Any) -> bytes:  # noqa: ANN401 (JSON)
    return common_json_bytes(doc, RAW)


def json_mutations(doc: Any) -> st.SearchStrategy[bytes]:  # noqa: ANN401 (JSON)
    """`fuzz_common.json_mutations` with this file's values."""
    return common_json_mutations(doc, WRONG, RAW, WHOLE)


def value_mutations(doc: Any, extra: list[Any] = ()) -> st.SearchStrategy[Any]:
    """``doc`` (Python data, not text) with one field replaced or deleted."""
    places = paths(doc)
    values = st.sampled_from([*WRONG, *extra])
    return st.one_of(
        st.builds(lambda p, v: mutated(doc, p, v), st.sampled_from(places), values),
        st.sampled_from([p for p in places if isinstance(p[-1], str)]).map(lambda p: mutated(doc, p, DELETE)),
    )


def deep(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# -- valid artifacts, made once by the real code -----------------------------------------------------------------


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny study of TopK (every study, figures off: only their files are read here; its SAE seed replicas, if the
    study trains several, one group): results.json with every section, the runs' exports, study_run.json and the
    checkpoint."""
    from test_evaluate import without_training_figures

    from sae_pipeline.evaluate.__main__ import main

    out = tmp_path_factory.mktemp("study")
    tiny = ["--k", "4", "--k_main", "4", "--p", "16", "--p_main", "16", "--max_steps", "5", "--k_infer", "2", "4"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_DPATH)
        without_training_figures(patch)
        # the study imports it when it runs: no figure drawn (they cost most of a tiny study and none is read here)
        patch.setattr("sae_pipeline.evaluate.report_figures.study_figures", lambda results, out_dpath: {})
        status, _, err = command(main, ["all", "--data", "digits", "--out", str(out), "--variants", "topk", *tiny])
        assert status == 0, err[-3000:]
    return out


def run_export(study: Path, name: str = "topk_p16_k4") -> Path:
    return study / "models" / name


def run_checkpoint(study: Path) -> Path:
    (found,) = (study / "runs").glob("*/checkpoints/last.ckpt")  # a group's when the study trains replicas
    return found


def name_flag(fpath: Path) -> list[str]:
    """``--name topk_p16_k4`` for a group's checkpoint, nothing for a single SAE's."""
    return ["--name", "topk_p16_k4"] if "group_" in fpath.parent.parent.name else []


# -- the readers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("examples", COUNTS)
def test_results_json_in_evaluate_report(study: Path, tmp_path: Path, examples: int) -> None:
    """`evaluate report --out DIR` on a results.json of every kind of damage (the issue's wrong-typed entry)."""
    from sae_pipeline.evaluate.__main__ import main

    valid = json.loads((study / "results.json").read_text())
    assert {"runs", "expressivity", "inference", "coherence", "concepts"} <= set(valid)
    out = tmp_path / "out"
    out.mkdir()
    fpath = out / "results.json"
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(*command(main, ["report", "--out", str(out)]), fpath)

    run()
    outcomes.done()
    fpath.write_text(json.dumps(valid))
    assert command(main, ["report", "--out", str(out)])[0] == 0  # the valid file still reads


def test_a_wrong_typed_entry_names_the_field(study: Path, tmp_path: Path) -> None:
    """The issue's case: one entry of another type is one line naming the file and the field, exit 2."""
    from sae_pipeline.evaluate.__main__ import main

    results = json.loads((study / "results.json").read_text())
    results["coherence"]["dictionary"]["topk"][1] = "0.5"
    (tmp_path / "results.json").write_text(json.dumps(results))
    status, _, err = command(main, ["report", "--out", str(tmp_path)])
    assert status == 2
    assert f"{tmp_path / 'results.json'}: coherence.dictionary.topk[1] must be a number, not '0.5'" in err


@pytest.mark.parametrize("examples", COUNTS)
def test_study_run_json(study: Path, tmp_path: Path, examples: int) -> None:
    """A run's record (`models/NAME/study_run.json`) read back: damaged, the run is not finished (trained again)."""
    from sae_pipeline.evaluate.runs import RUN_FNAME, read_run_record

    model = tmp_path / "model"
    shutil.copytree(run_export(study), model)
    valid = json.loads((model / RUN_FNAME).read_text())
    assert read_run_record(model) == valid
    seen = {"refused": 0}

    @fuzzed(examples)
    @given(json_mutations(valid))
    def run(data: bytes) -> None:
        (model / RUN_FNAME).write_bytes(data)
        record = read_run_record(model)
        assert record is None or isinstance(record["settings"], dict)
        seen["refused"] += record is None

    run()
    assert seen["refused"]


@pytest.mark.parametrize("examples", COUNTS)
def test_export_config_json(study: Path, tmp_path: Path, examples: int) -> None:
    """A native export's config.json, through `load_sae` (every `--sae DIR`)."""
    from sae_pipeline.artifacts import load_sae

    export = tmp_path / "export"
    shutil.copytree(run_export(study), export)
    fpath = export / "config.json"
    valid = json.loads(fpath.read_text())
    valid.pop("weights_sha256")  # else every edit is caught by the hash alone, and the fields never read
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid) | value_mutations(valid, [10**12]).map(json_bytes))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(*captured(lambda: load_sae(export)), fpath)

    run()
    outcomes.done()


def test_a_forged_size_is_refused_before_allocating(study: Path, tmp_path: Path) -> None:
    """d_sae = 10^12 in a config.json: refused from the weights' header, never allocated (4 TB)."""
    from sae_pipeline.artifacts import load_sae

    export = tmp_path / "export"
    shutil.copytree(run_export(study), export)
    config = json.loads((export / "config.json").read_text())
    config.pop("weights_sha256")
    config["init_args"]["d_sae"] = 10**12
    (export / "config.json").write_text(json.dumps(config))
    status, _, err = captured(lambda: load_sae(export))
    assert status == 2 and "d_sae = 1000000000000" in err and "W_dec of shape [16, 64]" in err, err


@pytest.fixture(scope="module")
def saelens_export(study: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sae_pipeline.artifacts.export import main

    out = tmp_path_factory.mktemp("saelens") / "topk"
    argv = ["--ckpt_path", str(run_checkpoint(study)), *name_flag(run_checkpoint(study)), "--out", str(out)]
    status, _, err = command(main, [*argv, "--format", "saelens"])
    assert status == 0, err
    return out


@pytest.mark.parametrize("examples", COUNTS)
def test_saelens_cfg_json(saelens_export: Path, tmp_path: Path, examples: int) -> None:
    """SAELens's cfg.json, through `load_sae`."""
    from sae_pipeline.artifacts import load_sae

    export = tmp_path / "saelens"
    shutil.copytree(saelens_export, export)
    fpath = export / "cfg.json"
    valid = json.loads(fpath.read_text())
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations(valid))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(*captured(lambda: load_sae(export)), fpath)

    run()
    outcomes.done()


@pytest.fixture(scope="module")
def checkpoint(study: Path) -> dict[str, Any]:
    return torch.load(run_checkpoint(study), map_location="cpu", weights_only=True)


def checkpoint_mutations(valid: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The checkpoint's saved configs, data record and sizes mutated (its tensors kept: torch.save writes them)."""
    keys = ("hyper_parameters", "datamodule_hyper_parameters", "data", "sae_config", "sae_group", "input_scale")
    parts = {key: valid[key] for key in keys if key in valid}
    wrong = [deep(200), torch.zeros(3), torch.zeros(10**2, 7)]

    def whole(changed: dict[str, Any]) -> dict[str, Any]:
        return {**valid, **changed}

    weights = st.builds(
        lambda key, value: whole({"state_dict": {**valid["state_dict"], key: value}}),
        st.sampled_from(sorted(valid["state_dict"])),
        st.sampled_from([None, "x", torch.zeros(2, 3), torch.zeros(0)]),
    )
    return value_mutations(parts, wrong).map(whole) | weights


@pytest.mark.parametrize("examples", COUNTS)
def test_checkpoint_in_export(
    checkpoint: dict[str, Any], study: Path, tmp_path: Path, examples: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint with its hyper-parameters, SAE config, input scale, data record or weights damaged, or cut
    short, through `export --ckpt_path FILE` (the one checkpoint reader every command uses); what it would write
    is not written (the reading is the test; fsynced files would be most of its time)."""
    from sae_pipeline.artifacts.export import main

    monkeypatch.setattr("sae_pipeline.artifacts.export.write_export_files", lambda *args, **kwargs: None)

    fpath = tmp_path / "damaged.ckpt"
    valid_bytes = run_checkpoint(study).read_bytes()
    name = name_flag(run_checkpoint(study))
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(checkpoint_mutations(checkpoint) | st.integers(0, len(valid_bytes) - 1))
    def run(change: dict[str, Any] | int) -> None:
        if isinstance(change, int):
            fpath.write_bytes(valid_bytes[:change])
        else:
            torch.save(change, fpath)
        argv = ["--ckpt_path", str(fpath), *name, "--out", str(tmp_path / "out")]
        outcomes.check(*command(main, argv), fpath)

    run()
    outcomes.done()


def test_a_checkpoint_nesting_deeper_than_any_reader_walks(
    checkpoint: dict[str, Any], study: Path, tmp_path: Path
) -> None:
    from sae_pipeline.artifacts.export import main

    fpath = tmp_path / "deep.ckpt"
    torch.save({**checkpoint, "callbacks": {"x": deep(200)}}, fpath)  # deeper: torch.save itself recurses
    argv = ["--ckpt_path", str(fpath), *name_flag(run_checkpoint(study)), "--out", str(tmp_path / "o")]
    status, _, err = command(main, argv)
    assert status == 2 and "nests its data more than 64 deep" in err, err


@pytest.mark.parametrize(
    ("part", "value", "expected"),
    [
        (("hyper_parameters", "members", "topk_p16_k4", "sae", "init_args", "d_sae"), 10**12, "d_sae = 1000000000000"),
        (("sae_group", "topk_p16_k4", "sae_config"), "TopKSAE", "sae_config: the SAE config must be an object"),
        (("sae_group", "topk_p16_k4", "hyper_parameters"), [CONTROL], "hyper_parameters is not a mapping"),
    ],
)
def test_checkpoint_hyper_parameters_in_validate(
    checkpoint: dict[str, Any], study: Path, tmp_path: Path, part: tuple, value: Any, expected: str
) -> None:
    """The checkpoint's saved configs, as `validate --ckpt_path` (LightningCLI, `ckpt_config.py`) would merge them:
    refused in one line naming the checkpoint before the model is built."""
    from sae_pipeline.__main__ import main

    if "sae_group" not in checkpoint:
        pytest.skip("the study trained a single SAE: this checks a group's checkpoint")
    damaged = copy.deepcopy(checkpoint)
    node = damaged
    for key in part[:-1]:
        node = node.setdefault(key, {})
    node[part[-1]] = value
    fpath = tmp_path / "damaged.ckpt"
    torch.save(damaged, fpath)
    config = run_checkpoint(study).parent.parent / "group.yaml"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        argv = [
            "validate",
            "--config",
            str(config),
            "--ckpt_path",
            str(fpath),
            "--trainer.enable_progress_bar",
            "false",
        ]
        status, out, err = command(main, argv)
    Outcomes().check(status, out, err, fpath)
    assert status == 2 and expected in err, err[-3000:]


@pytest.fixture(scope="module")
def codes_file(study: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A codes file as `predict` writes it (`CodesWriter`), of the study's TopK on a few rows."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.artifacts.codes import CodesWriter

    sae = load_sae(run_export(study))
    codes = sae.encode(torch.randn(20, sae.d_in))
    values, indices = codes.topk(4, dim=1)
    fpath = tmp_path_factory.mktemp("codes") / "codes.h5"
    with CodesWriter(fpath, {"d_sae": sae.d_sae, "variant": "topk"}) as writer:
        ids = [f"img{i // 5}" for i in range(20)]
        writer.write(ids, np.arange(20) % 5, indices.numpy(), values.detach().numpy())
    return fpath


def rewrite_codes(fpath: Path, change: tuple[str, str, Any]) -> None:
    """One structural change to a codes file, with h5py."""
    kind, name, value = change
    with h5py.File(fpath, "r+") as h5:
        if kind == "attr":
            h5.attrs[name] = value
        elif kind == "delete":
            del h5[name]
        elif kind == "replace":
            del h5[name]
            h5.create_dataset(name, data=value)
        elif kind == "resize":  # declared, never written: a size the file does not hold
            h5[name].resize(value)


CODES_CHANGES = st.one_of(
    st.tuples(st.just("attr"), st.sampled_from(["format", "d_sae"]), st.sampled_from([CONTROL[:-1], "codes/2", -1, 0])),
    st.tuples(st.just("delete"), st.sampled_from(["image_ids", "token_positions", "indices", "values"]), st.none()),
    st.tuples(
        st.just("replace"),
        st.sampled_from(["image_ids", "token_positions", "indices", "values"]),
        st.sampled_from([np.zeros(3), np.zeros((20, 4, 2)), np.array([CONTROL.encode("utf-8", "replace")] * 20)]),
    ),
    st.tuples(st.just("resize"), st.sampled_from(["token_positions", "image_ids"]), st.just((10**12,))),
    st.tuples(st.just("resize"), st.just("indices"), st.sampled_from([(10**9, 4), (20, 10**9)])),
)


@pytest.mark.parametrize("examples", COUNTS)
def test_codes_h5(codes_file: Path, tmp_path: Path, examples: int) -> None:
    """A codes file (`read_codes`, the reader of `predict`'s output) changed in structure, or cut short."""
    from sae_pipeline.artifacts import read_codes

    fpath = tmp_path / "codes.h5"
    valid = codes_file.read_bytes()
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(CODES_CHANGES | st.integers(0, len(valid) - 1))
    def run(change: tuple | int) -> None:
        fpath.write_bytes(valid if not isinstance(change, int) else valid[:change])
        if not isinstance(change, int):
            rewrite_codes(fpath, change)
        outcomes.check(*captured(lambda: read_codes(fpath)), fpath)

    run()
    outcomes.done()


@pytest.fixture(scope="module")
def site(study: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A feature browser site of the study's TopK, built by `features`."""
    from sae_pipeline.__main__ import main

    out = tmp_path_factory.mktemp("site") / "site"
    status, _, err = command(
        main, ["features", "--sae", str(run_export(study)), "--data.source", "digits", "--out", str(out)]
    )
    assert status == 0, err[-3000:]
    return out


@pytest.mark.parametrize("examples", COUNTS)
def test_features_json_of_a_site(site: Path, study: Path, tmp_path: Path, examples: int) -> None:
    """A site's features.json, as `features explain --site` checks it against the SAE."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.features.explain_pages import check_site

    sae = load_sae(run_export(study))
    copy_site = tmp_path / "site"
    copy_site.mkdir()
    fpath = copy_site / "features.json"
    valid = json.loads((site / "features.json").read_text())
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(json_mutations({key: valid[key] for key in ("format", "d_in", "d_sae", "sae_sha256", "k")}))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(*captured(lambda: check_site(copy_site, sae)), fpath)

    run()
    outcomes.done()


NPZ_CHANGES = st.tuples(
    st.sampled_from(["W_dec", "b_pre", "other"]),
    st.sampled_from(
        [np.array([CONTROL]), np.zeros((2, 3, 4)), np.zeros(0), np.full((20, 784), np.nan), np.ones(7), np.zeros(())]
    ),
)


@pytest.mark.parametrize("examples", COUNTS)
def test_dictionary_npz(reference_dictionary_fpath: Path, tmp_path: Path, examples: int) -> None:
    """An external dictionary (`evaluate dictionary --npz FILE`): arrays of other kinds or shapes, or cut short."""
    from sae_pipeline.evaluate.external import load_npz_dictionary

    with np.load(reference_dictionary_fpath) as archive:  # the paper's, cut to 20 atoms
        valid = {"W_dec": archive["W_dec"][:20], "b_pre": archive["b_pre"]}
    fpath = tmp_path / "dictionary.npz"
    np.savez_compressed(fpath, **valid)
    valid_bytes = fpath.read_bytes()
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(NPZ_CHANGES | st.integers(0, len(valid_bytes) - 1))
    def run(change: tuple | int) -> None:
        if isinstance(change, int):
            fpath.write_bytes(valid_bytes[:change])
        else:
            np.savez_compressed(fpath, **{**valid, change[0]: change[1]})
        outcomes.check(*captured(lambda: load_npz_dictionary(fpath, k=4)), fpath)

    run()
    outcomes.done()


def test_a_sites_image_ids_reach_the_terminal_escaped(tmp_path: Path) -> None:
    """The images a site lists as changed (ids from the shards, another program's files) are printed escaped."""
    from sae_pipeline.features.cli import report_image_checks

    changed = [{"image_id": f"img{CONTROL}", "where": f"shard-000000.tar {CONTROL}"}]
    (tmp_path / "features.json").write_text(json.dumps({"images_changed": changed, "images_unchecked": 0}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        report_image_checks(tmp_path)
    assert "img\\x1b[2J\\x07\\x08\\u202e\\x00" in err.getvalue() and not RAW_CONTROL.search(err.getvalue())


# -- YAML: the run's config, its pieces, a group's members ------------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8)
)


def yaml_mutations(doc: dict[str, Any]) -> st.SearchStrategy[bytes]:
    text = yaml.safe_dump(doc, sort_keys=False).encode()
    return st.one_of(
        value_mutations(doc).map(lambda d: yaml.safe_dump(d, sort_keys=False).encode()),
        st.integers(0, len(text) - 1).map(lambda n: text[:n]),
        st.sampled_from(
            [
                b"[" * 20_000 + b"]" * 20_000,
                BOMB.encode(),
                b"model: {sae: \x1b[2J}\n",
                b"\xff\xfe not utf-8",
                b"- a\n- b\n",
                b"model: " + b"{a: " * 100 + b"1" + b"}" * 100,
            ]
        ),
    )


@pytest.mark.parametrize("examples", COUNTS)
def test_run_yaml(tmp_path: Path, examples: int) -> None:
    """A training config read as data (`load_config`: the studies, `features --config`) and checked before the
    CLI's parser reads it (`check_config_files`, what `fit --config` runs first)."""
    from sae_pipeline.cli_args import check_config_files
    from sae_pipeline.config_files import load_config

    valid = load_config(REPO_DPATH / "configs" / "topk_digits.yaml")
    fpath = tmp_path / "run.yaml"
    outcomes = Outcomes()

    @fuzzed(examples)
    @given(yaml_mutations(valid))
    def run(data: bytes) -> None:
        fpath.write_bytes(data)
        outcomes.check(*captured(lambda: load_config(fpath)), fpath)
        outcomes.check(*captured(lambda: check_config_files(["--config", str(fpath)])), fpath)

    run()
    outcomes.done()


@pytest.mark.parametrize("examples", COUNTS)
def test_group_members(tmp_path: Path, examples: int) -> None:
    """A group's `model.members` (the group YAML, as the CLI hands it over): each member's problem is one line
    naming it (`model.members.NAME...`), exit 2."""
    from sae_pipeline.training.group import SAEGroupModule

    valid = {
        "topk": {"sae": {"class_path": "sae_pipeline.sae.TopKSAE", "init_args": {"d_sae": 16, "k": 4}}, "lr": 1e-3},
        "relu": {"sae": {"class_path": "ReLUSAE", "init_args": {"d_sae": 16}}, "seed": 3, "gradient_clip_val": 1.0},
    }
    refused = {"n": 0}

    @fuzzed(examples)
    @given(value_mutations(valid, [deep(200), 10**12]))
    def run(members: dict[str, Any]) -> None:
        status, out, err = captured(lambda: SAEGroupModule(members=members, d_in=8))
        assert "Traceback" not in err and not RAW_CONTROL.search(out + err), err[-3000:]
        if status:
            errors = [line for line in err.splitlines() if line.startswith("error:")]
            assert status == 2 and len(errors) == 1 and "model.members" in errors[0], err[-3000:]
            refused["n"] += 1

    run()
    assert refused["n"]
