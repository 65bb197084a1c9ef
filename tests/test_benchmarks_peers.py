"""``python -m benchmarks.peers``, ``python -m benchmarks.gpu`` and ``python -m benchmarks.sparse_kernels`` in their
tiny dry-run modes: every contender steps, and every peer that is installed (the ``bench`` extra) computes the same
codes, x_hat and gradients as ours from the same weights (MP-SAE included: SAELens's ``matching_pursuit`` and
overcomplete's ``MpSAE``); the TopK family is timed with no dead latent and with dead ones, every library's own
bookkeeping counting the same latents dead.

The dry runs call each module's ``main(argv)`` in this process (what ``python -m benchmarks.NAME ARGV`` runs), on one
torch thread, the environment and thread count restored after: a fresh interpreter per run cost its imports each
time (torch, SAELens and the peers: about 20 s of a loaded 2-core box), and a second torch thread only adds
hand-offs at these sizes. The dry runs are still marked slow (importing SAELens, timm and the peers once, about
15 s). SAELens compiled (its runner's ``compile_sae``, ``torch.compile`` with inductor) is checked on the CPU for
its wiring only, with dynamo's eager backend; its inductor compile runs on CUDA, in the ``gpu``-marked test (see
their docstrings)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

REPO_DPATH = Path(__file__).resolve().parents[1]
PEER_MODULES = {
    "SAELens": "sae_lens",
    "overcomplete": "overcomplete",
    "sparsify": "sparsify",
    "dictionary_learning": "dictionary_learning",
}
AUXK_VARIANTS = ("topk", "batchtopk", "matryoshka")  # timed twice: no dead latent, then 1/16 of them dead
PEER_VARIANTS = {  # the variants each library has
    "ours": ("topk", "batchtopk", "matryoshka", "jumprelu", "relu", "mpsae"),
    "SAELens": ("topk", "batchtopk", "matryoshka", "jumprelu", "relu", "mpsae"),
    "overcomplete": ("topk", "batchtopk", "jumprelu", "relu", "mpsae"),
    "sparsify": ("topk",),
    "dictionary_learning": ("topk", "batchtopk", "matryoshka", "jumprelu", "relu"),
}


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.MODULE ARGS`` from the repository root, as BENCHMARKS.md runs them."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_DPATH,
    )


@pytest.fixture
def dry_run(capsys: pytest.CaptureFixture) -> Iterator[Callable[..., str]]:
    """``main(argv)`` of ``benchmarks.MODULE`` in this process; returns what it printed. The test runs on one torch
    thread; the environment (the peers' imports set some: cv2's ``LD_LIBRARY_PATH``, ``KMP_*``; peers.py
    ``SPARSIFY_DISABLE_TRITON``) and torch's thread count are restored after."""
    environ, threads = dict(os.environ), torch.get_num_threads()

    def main(module: str, *argv: str) -> str:
        capsys.readouterr()
        importlib.import_module(f"benchmarks.{module}").main(list(argv))
        return capsys.readouterr().out

    torch.set_num_threads(1)
    try:
        yield main
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)


def usage_error(capsys: pytest.CaptureFixture, parse_args: Callable[[list[str]], object], *argv: str) -> str:
    """What ``parse_args(argv)`` writes to stderr when it exits 2 (argparse's usage and one error line)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def table_rows(stdout: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ") and not line.startswith(("| d_in", "| variant", "| d_sae"))
    ]


def contender_rows(stdout: str) -> list[list[str]]:
    """peers.py's rows, one per contender and block: d_in, d_sae, contender, step, ÷ ours, ÷ GEMM, peak memory,
    resident, equal to ours, dead."""
    return [row for row in table_rows(stdout) if len(row) == 10]


def check_contender_rows(rows: list[list[str]]) -> None:
    """Every row's figures are sane, every peer equal to ours, and the dead column says what each block timed:
    the TopK family first with no dead latent, then with 1/16 of them dead (4 of 64) in every library that has
    AuxK, overcomplete's step having none."""
    seen: dict[str, int] = {}
    for row in rows:
        step, vs_ours, vs_gemm, peak, resident, equal = row[3], float(row[4]), float(row[5]), row[6], row[7], row[8]
        assert step.endswith(" s") and vs_ours > 0 and vs_gemm > 0
        assert 0 < float(resident.split()[0]) <= float(peak.split()[0]), row
        assert equal == "reference" if row[2].startswith("ours") else equal.startswith("equal ("), row
        library, variant = row[2].split()
        block = seen[row[2]] = seen.get(row[2], 0) + 1  # the contender's first or second block
        if variant not in AUXK_VARIANTS:
            assert row[9] == "—" and block == 1, row
        elif library == "overcomplete":
            assert row[9] == "no AuxK", row
        else:
            assert row[9] == ("0.0 %" if block == 1 else "6.2 %"), row


@pytest.mark.slow
def test_peers_dry_run_every_contender_steps_and_agrees_with_ours(dry_run: Callable[..., str]) -> None:
    stdout = dry_run("peers", "--dry-run")
    assert ", 1 threads," in stdout.splitlines()[0]  # the dry run's own default
    rows = contender_rows(stdout)
    names = [row[2] for row in rows]
    for library, variants in PEER_VARIANTS.items():
        if library != "ours" and importlib.util.find_spec(PEER_MODULES[library]) is None:
            assert f"{library}: not installed" in stdout
            continue
        expected = [f"{library} {v}" for v in variants for _ in range(2 if v in AUXK_VARIANTS else 1)]
        assert sorted(name for name in names if name.startswith(f"{library} ")) == sorted(expected), stdout
    check_contender_rows(rows)
    assert "its step failed" not in stdout
    # the last table: per block, the fastest peer against ours
    fastest = [row for row in table_rows(stdout) if len(row) == 7]
    blocks = [(row[1], row[2]) for row in fastest]
    assert blocks == [
        (v, dead) for v in PEER_VARIANTS["ours"] for dead in (["none", "6.2 %"] if v in AUXK_VARIANTS else ["none"])
    ]
    for row in fastest:
        library = row[4].split()[0]
        assert library in PEER_MODULES and float(row[5]) > 0 and float(row[6]) > 0, row


@pytest.mark.slow
def test_peers_saelens_compile_is_wired_and_steps_as_saelens(
    dry_run: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SAELens+compile`` on the CPU, its wiring only: it asks ``torch.compile`` for what SAELens's runner asks with
    ``compile_sae`` (its training forward, inductor, ``sae_compilation_mode`` None), its step goes through the
    compiled function, and that function computes ours; its steps (with dead latents, so AuxK's branch is traced)
    are SAELens's own, to the bit. The compile is traced by dynamo with its eager backend here: inductor would
    spend about a minute generating C++ for the CPU whatever the size, which says nothing of the GPU where the
    figure is timed; the real compile runs on CUDA in the test below (``gpu``) and in the GPU suite's
    ``peers_compiled`` part."""
    if importlib.util.find_spec("sae_lens") is None:
        pytest.skip("SAELens is not installed (the bench extra)")
    from sae_lens.saes.sae import TrainStepInput

    from benchmarks.peer_adapters import DEAD_AFTER, Ours
    from benchmarks.peer_measure import make_batch, make_template, with_dead_latents
    from benchmarks.peer_saelens import SAELens, SAELensCompiled

    asked: list[tuple[Callable, dict]] = []
    compile_eagerly = torch.compile

    def recorded(fn: Callable, **kwargs: object) -> Callable:
        asked.append((fn, kwargs))
        return compile_eagerly(fn, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", recorded)  # dry_run: one thread, the environment restored after
    x = make_batch(16, 32)
    template = with_dead_latents(make_template("topk", 16, 64, 4, x), x, 1 / 16)
    compiled, plain = SAELensCompiled("topk", template, 32, 4), SAELens("topk", template, 32, 4)
    try:
        assert len(asked) == 1 and asked[0][0] == compiled.model.training_forward_pass
        assert asked[0][1] == {"mode": None, "backend": "inductor"}
        assert compiled.training_forward is compiled.compiled and plain.training_forward != compiled.compiled
        assert compiled.min_warmup >= 3  # peers.py times it after compiling
        step_input = TrainStepInput(
            sae_in=x,
            coefficients=compiled.coefficients,
            dead_neuron_mask=compiled.since_fired > DEAD_AFTER,
            n_training_steps=0,
            is_logging_step=False,
        )
        out = compiled.training_forward(step_input)
        with torch.no_grad():
            codes, x_hat = Ours("topk", template, 32, 4).forward(x)
        torch.testing.assert_close(out.feature_acts.detach(), codes, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.sae_out.detach(), x_hat, rtol=1e-5, atol=1e-6)
        for _ in range(compiled.min_warmup + 1):
            compiled.step(x)
            plain.step(x)
        assert int(compiled.dead_mask().sum()) == int(plain.dead_mask().sum()) == 4
        for (name, ours), (_, theirs) in zip(compiled.model.named_parameters(), plain.model.named_parameters()):
            assert torch.equal(ours, theirs), name
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(900)
def test_peers_saelens_compiled_steps_after_compiling_and_agrees() -> None:
    """``--peers SAELens+compile`` on CUDA, where it is timed: SAELens's training forward through ``torch.compile``
    (its ``compile_sae``, inductor), compiled in the warm-up (once per dead-mask branch), then timed; the same
    function as ours. On a GPU only: on the CPU inductor's compile took about a minute of the suite's 25 (C++
    codegen, whatever the size) and proved nothing of the step that matters; the CPU checks the wiring above."""
    if importlib.util.find_spec("sae_lens") is None:
        pytest.skip("SAELens is not installed (the bench extra)")
    result = run("peers", "--dry-run", "--device", "cuda", "--variants", "topk", "--peers", "SAELens+compile")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = contender_rows(result.stdout)
    assert [row[2] for row in rows] == ["ours topk", "SAELens+compile topk"] * 2, result.stdout
    check_contender_rows(rows)
    assert "its step failed" not in result.stdout


def test_peers_bad_dead_fraction_is_one_line_exit_2(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import peers

    assert "--dead-fraction must be in [0, 1), got 1.0" in usage_error(capsys, peers.parse_args, "--dead-fraction", "1")


def test_peers_bad_argument_is_one_line_exit_2(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import peers

    assert "--k must be >= 1, got 0" in usage_error(capsys, peers.parse_args, "--k", "0")


@pytest.mark.slow
def test_gpu_dry_run_reports_every_variant_and_extraction(dry_run: Callable[..., str]) -> None:
    stdout = dry_run("gpu", "--dry-run")
    rows = {row[0]: row for row in table_rows(stdout)}
    from sae_pipeline.sae import SAE_REGISTRY

    assert set(rows) == set(SAE_REGISTRY)
    for variant, row in rows.items():
        assert float(row[2].replace(",", "")) > 0
        assert (row[3] == "—") == SAE_REGISTRY[variant].is_pursuit  # no roofline for a pursuit
    assert "images/s" in stdout.splitlines()[-1]


@pytest.mark.slow
def test_sparse_kernels_dry_run_times_every_product(dry_run: Callable[..., str]) -> None:
    """``python -m benchmarks.sparse_kernels --dry-run``: every row timed on the CPU (Triton's column needs CUDA)."""
    stdout = dry_run("sparse_kernels", "--dry-run")
    rows = {row[0]: row for row in table_rows(stdout) if row[0] != "product"}
    assert set(rows) == {"decode", "dW_dec", "dvalues", "decode fwd+bwd", "batchtopk select"}
    for row in rows.values():
        assert row[1] == "needs CUDA" and row[2].endswith(" ms"), row


def test_gpu_without_cuda_says_so(capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    from benchmarks import gpu

    assert "no CUDA device is visible" in usage_error(capsys, gpu.parse_args)
