"""The sparse products' choice of Triton kernel or cuBLAS (`sae_pipeline/sae/product_choice.py`) on the CPU.

The CPU has no Triton path, so these tests stand in for it: ``_gpu_kernels`` answers with `FakeKernels`
(the kernels' signatures over `F.embedding_bag`, the CPU's own sparse path) and the chooser gets a
`FakeTimer` (fixed timings, counted calls) and a capture flag. They check the key, one measurement per
key, that the chosen path is the one run, that both paths equal a plain dense reference (float64, fresh
random inputs: each product, and every shallow variant's whole step), that nothing is measured while a
CUDA graph is captured, the once-per-fit log line, and the benchmark's chooser table. The real kernels
against the dense form run under Triton's interpreter (`tests/product_choice_checks.py`, in a fresh
process as `tests/test_triton_sparse.py` does), and on CUDA in the next GPU run.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae import TopKSAE, product_choice, sparse_decode
from sae_pipeline.sae.product_choice import DENSE, SPARSE, Key, ProductChooser, entries_per_token
from sae_pipeline.sae.sparse_decode import SparseCodes
from sae_pipeline.training.module import SAEModule
from tests.sparse_kernel_checks import ragged_codes, topk_codes
from tests.test_module import make_data, memory_loader, trainer
from tests.test_sparse_decode import MAKERS, batch, kill_every_third, make, our_step, reference_step

ROOT = Path(__file__).resolve().parents[1]


class FakeKernels(types.SimpleNamespace):
    """`triton_sparse`'s two entry points on the CPU, through ATen (each call counted)."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    def segment_sums(
        self, offsets: Tensor, index: Tensor, table: Tensor, weights: Tensor, order: Tensor | None = None, **_: object
    ) -> Tensor:
        self.calls.append("segment_sums")
        weights = weights if order is None else weights.index_select(0, order)
        return F.embedding_bag(
            index,
            table.contiguous(),
            offsets,
            mode="sum",
            per_sample_weights=weights.to(table.dtype),
            include_last_offset=True,
        )

    def entry_dots(self, rows: Tensor, indices: Tensor, tokens: Tensor, weight: Tensor, **_: object) -> Tensor:
        self.calls.append("entry_dots")
        return (tokens[rows] * weight[indices].to(tokens.dtype)).sum(1)


class FakeTimer:
    """``(sparse seconds, dense seconds)`` from ``timings``, one pair per call in turn (the last repeated)."""

    def __init__(self, *timings: tuple[float, float]) -> None:
        self.timings = list(timings)
        self.calls = 0

    def __call__(self, sparse: object, dense: object, device: torch.device) -> tuple[float, float]:
        self.calls += 1
        return self.timings[min(self.calls, len(self.timings)) - 1]


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> FakeKernels:
    fake = FakeKernels()
    monkeypatch.setattr(sparse_decode, "use_triton", True)
    monkeypatch.setattr(sparse_decode, "_gpu_kernels", lambda *operands: fake if sparse_decode.use_triton else None)
    return fake


def install(monkeypatch: pytest.MonkeyPatch, timer: FakeTimer, capturing: list[bool] | None = None) -> ProductChooser:
    """A fresh chooser for `sparse_decode` to ask, with ``timer`` and ``capturing[0]`` as the capture flag."""
    flag = capturing if capturing is not None else [False]
    chooser = ProductChooser(timer=timer, capturing=lambda device: flag[0])
    monkeypatch.setattr(product_choice, "CHOOSER", chooser)
    return chooser


def operands(batch_size: int = 6, d_sae: int = 16, d_in: int = 5, k: int = 3, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(batch_size * 1000 + d_sae)
    codes = SparseCodes.from_topk(torch.rand(batch_size, d_sae, generator=g).topk(k, dim=1).indices, d_sae)
    weight = torch.randn(d_sae, d_in, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(batch_size * k, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(batch_size, d_in, generator=g, dtype=torch.float64).to(dtype)
    return codes, weight, values, grad


# --- the key, and one measurement per key --------------------------------------------------------------------
def test_entries_per_token_is_k_rounded_up_to_a_power_of_two() -> None:
    assert entries_per_token(4096 * 32, 4096) == 32
    assert [entries_per_token(n, 2) for n in (0, 1, 2, 3, 5, 9, 66)] == [1, 1, 1, 2, 4, 8, 64]
    assert entries_per_token(7, 0) == 8  # no token: no division by zero


def test_the_key_names_product_device_dtype_and_shape(kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    chooser = install(monkeypatch, FakeTimer((1.0, 2.0)))
    codes, weight, values, grad = operands(batch_size=6, d_sae=16, d_in=5, k=3)
    sparse_decode.token_sums(codes, weight, values)
    sparse_decode.latent_sums(codes, grad, values)
    sparse_decode.latent_sums(codes, grad, values, "dW_enc")
    sparse_decode.entry_dots(codes, grad, weight)
    sparse_decode.token_sums(codes, weight, values, "dx")
    assert list(chooser.choices) == [
        Key(product, "cpu", torch.float64, 6, 16, 5, 4) for product in ("decode", "dW_dec", "dW_enc", "dvalues", "dx")
    ]
    assert set(product_choice.PRODUCTS) == {key.product for key in chooser.choices}
    assert product_choice.device_name(torch.device("cpu")) == "cpu"


def test_each_key_is_measured_once(kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer((1.0, 2.0))
    chooser = install(monkeypatch, timer)
    codes, weight, values, _ = operands()
    for _ in range(3):
        sparse_decode.token_sums(codes, weight, values)
    assert timer.calls == chooser.measurements == 1
    sparse_decode.token_sums(*operands(batch_size=7)[:3])  # another B
    sparse_decode.token_sums(codes, weight.float(), values.float())  # another dtype
    sparse_decode.token_sums(*operands(k=5)[:3])  # another count per token (5 -> 8)
    sparse_decode.token_sums(*operands(k=4)[:3])  # 4: k = 3's bucket, kept
    sparse_decode.token_sums(*operands(d_in=9)[:3])  # another width
    assert timer.calls == 5 and len(chooser.choices) == 5
    for _ in range(2):  # all kept
        sparse_decode.token_sums(*operands(batch_size=7)[:3])
        sparse_decode.token_sums(codes, weight, values)
    assert timer.calls == 5
    assert install(monkeypatch, FakeTimer((1.0, 2.0))).choices == {}  # per chooser (the process's one: CHOOSER)


@pytest.mark.parametrize("faster", [SPARSE, DENSE])
def test_the_faster_path_is_the_one_run(faster: str, kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer((1e-3, 2e-3) if faster == SPARSE else (2e-3, 1e-3))
    chooser = install(monkeypatch, timer)
    dense_calls: list[str] = []
    for name in ("_dense_token_sums", "_dense_latent_sums", "_dense_entry_dots"):
        real = getattr(sparse_decode, name)
        monkeypatch.setattr(
            sparse_decode, name, lambda *args, _real=real, _name=name: dense_calls.append(_name) or _real(*args)
        )
    codes, weight, values, grad = operands()
    for _ in range(2):
        sparse_decode.token_sums(codes, weight, values)
        sparse_decode.latent_sums(codes, grad, values)
        sparse_decode.entry_dots(codes, grad, weight)
    assert timer.calls == 3  # the fake timer runs neither path: every call below is the product's own
    assert {choice.path for choice in chooser.choices.values()} == {faster}
    if faster == SPARSE:
        assert kernels.calls == ["segment_sums", "segment_sums", "entry_dots"] * 2 and dense_calls == []
    else:
        assert (
            kernels.calls == [] and dense_calls == ["_dense_token_sums", "_dense_latent_sums", "_dense_entry_dots"] * 2
        )


def test_the_real_timer_runs_both_paths_and_keeps_the_faster(
    kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`event_timer` on the CPU (the host's clock): warm-up and timed calls of both, then the kept path."""
    monkeypatch.setattr(product_choice, "CHOOSER", ProductChooser())
    codes, weight, values, _ = operands()
    out = sparse_decode.token_sums(codes, weight, values)
    (choice,) = product_choice.CHOOSER.choices.values()
    assert choice.measured and choice.sparse_seconds > 0 and choice.dense_seconds > 0
    assert choice.path == (DENSE if choice.dense_seconds < choice.sparse_seconds else SPARSE)
    assert len(kernels.calls) == 3 + 10 + (choice.path == SPARSE)
    torch.testing.assert_close(out, codes.with_values(values).to_dense() @ weight, rtol=1e-12, atol=1e-12)


# --- the two paths compute the same sums -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["topk", "ragged"])
def test_both_paths_equal_a_plain_dense_reference_float64(
    layout: str, kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each product on each path against dense float64 math, with repeated latents, empty tokens, unused latents."""
    chooser = install(monkeypatch, FakeTimer((1.0, 2.0)))
    make_codes = topk_codes if layout == "topk" else ragged_codes
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        codes = make_codes(12, 40, 4, g, "cpu")
        nnz = codes.indices.numel()
        W_dec = torch.randn(40, 7, generator=g, dtype=torch.float64)
        W_enc = torch.randn(7, 40, generator=g, dtype=torch.float64)  # its .T: a strided table
        tokens = torch.randn(12, 7, generator=g, dtype=torch.float64)
        values = torch.randn(nnz, generator=g, dtype=torch.float64)
        dense = torch.zeros(12, 40, dtype=torch.float64).index_put((codes.rows, codes.indices), values, accumulate=True)
        reference = {
            "decode": dense @ W_dec,
            "dW_dec": dense.T @ tokens,
            "dvalues": (tokens @ W_dec.T)[codes.rows, codes.indices],
            "dx": dense @ W_enc.T,
        }
        for path in (SPARSE, DENSE):
            with chooser.forcing(path):
                got = {
                    "decode": sparse_decode.token_sums(codes, W_dec, values),
                    "dW_dec": sparse_decode.latent_sums(codes, tokens, values),
                    "dvalues": sparse_decode.entry_dots(codes, tokens, W_dec),
                    "dx": sparse_decode.token_sums(codes, W_enc.T, values, "dx"),
                }
            for name, ref in reference.items():
                torch.testing.assert_close(got[name], ref, rtol=1e-12, atol=1e-12, msg=f"{layout} {path} {name}")
                assert got[name].dtype == torch.float64
    assert chooser.measurements == 0  # forced: nothing measured


@pytest.mark.parametrize("with_dead", [False, True], ids=["no-dead", "dead"])
@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("path", [SPARSE, DENSE])
def test_every_shallow_step_on_either_path_equals_the_reference_float64(
    path: str, name: str, with_dead: bool, kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variant's whole step (forward, loss, backward, AuxK, the parallel-gradient removal) with every product
    on one path: the plain dense autograd of `tests/test_sparse_decode.py`, to float64 rounding."""
    chooser = install(monkeypatch, FakeTimer((2.0, 1.0) if path == DENSE else (1.0, 2.0)))
    template = make(name)
    if with_dead:
        kill_every_third(template)
    x = batch()
    x_hat, codes, loss, grads = reference_step(name, template, x)
    out, our_loss, our_grads = our_step(copy.deepcopy(template), x, 1.0)
    assert out.sparse is not None and chooser.choices and {c.path for c in chooser.choices.values()} == {path}
    torch.testing.assert_close(out.x_hat.detach(), x_hat, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(our_loss, loss, rtol=1e-12, atol=1e-12)
    for pname, grad in grads.items():
        torch.testing.assert_close(our_grads[pname], grad, rtol=1e-11, atol=1e-12, msg=f"{name} {path} d{pname}")


def test_input_gradient_on_either_path(kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """``∂x`` (the W_enc.T gather, product "dx") when the input needs a gradient, against the dense path."""
    install(monkeypatch, FakeTimer((1.0, 2.0), (2.0, 1.0)))
    template = make("topk")
    x = batch().requires_grad_(True)
    template.sparse_max_density = 0.0
    reference = torch.autograd.grad(template.loss(x, template(x)).loss, x)[0]
    for path in (SPARSE, DENSE):
        sae = copy.deepcopy(template)
        sae.sparse_max_density = 1.0
        with product_choice.CHOOSER.forcing(path):
            out = sae(x)
            assert out.sparse is not None
            got = torch.autograd.grad(sae.loss(x, out).loss, x)[0]
        torch.testing.assert_close(got, reference, rtol=1e-11, atol=1e-12, msg=path)


# --- no measurement while a CUDA graph is captured -----------------------------------------------------------
def test_nothing_is_measured_while_capturing(kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    capturing = [True]
    timer = FakeTimer((2.0, 1.0))
    chooser = install(monkeypatch, timer, capturing)
    codes, weight, values, _ = operands()
    expected = codes.with_values(values).to_dense() @ weight
    out = sparse_decode.token_sums(codes, weight, values)  # a key first seen during a capture: the kernel
    torch.testing.assert_close(out, expected)
    assert timer.calls == 0 and chooser.choices == {} and kernels.calls == ["segment_sums"]
    assert chooser.report() == [
        "sparse path: decode (x_hat = Σ z · W_dec[j] per token) runs as the Triton kernel, not measured (first seen "
        "during a CUDA graph capture) [cpu, float64, B 6, d_sae 16, d_in 5, 4 entries per token]"
    ]
    capturing[0] = False  # the first eager call measures (dense is faster here) and keeps it
    sparse_decode.token_sums(codes, weight, values)
    assert timer.calls == 1 and chooser.choices[next(iter(chooser.choices))].path == DENSE
    assert len(chooser.report()) == 1  # the measured choice is said too
    capturing[0] = True  # captured again: the kept choice, no measurement
    kernels.calls.clear()
    torch.testing.assert_close(sparse_decode.token_sums(codes, weight, values), expected)
    assert timer.calls == 1 and kernels.calls == [] and chooser.report() == []


def test_the_default_capture_test_asks_cuda_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or True)
    assert product_choice.stream_capturing(torch.device("cpu")) is False and asked == []
    assert product_choice.stream_capturing(torch.device("cuda")) is True and asked == [1]


# --- the once-per-fit log line ---------------------------------------------------------------------------------
def test_each_choice_is_logged_once_per_fit(
    tmp_path: Path, kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A TopK fit on the CPU through the stand-in kernels: after its first step one INFO line per product used
    (the decode, its two gradients, ∂W_enc), none later; a second fit says them again without measuring."""
    timer = FakeTimer((1e-3, 2e-3), (3e-3, 2e-3))  # the decode on the kernel, the others on cuBLAS
    chooser = install(monkeypatch, timer)
    torch.manual_seed(0)
    module = SAEModule(TopKSAE(16, 64, k=4), warmup_steps=0)
    data = make_data(4 * 32)
    said = []
    for fit in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer(tmp_path / str(fit), max_steps=4 * (fit + 1)).fit(module, memory_loader(data))
        said.append([record.getMessage() for record in caplog.records if "sparse path:" in record.getMessage()])
        assert all(record.levelno == logging.INFO for record in caplog.records if "sparse path:" in record.getMessage())
    assert said[0] == said[1] and timer.calls == 4
    assert [line.split(" (")[0] for line in said[0]] == [
        "sparse path: decode",
        "sparse path: dvalues",
        "sparse path: dW_dec",
        "sparse path: dW_enc",
    ]
    assert "runs as the Triton kernel: measured 1.000 ms as the Triton kernel, 2.000 ms as cuBLAS" in said[0][0]
    assert all("runs as cuBLAS (dense): measured 3.000 ms" in line for line in said[0][1:])
    assert all("[cpu, float32, B 32, d_sae 64, d_in 16, 4 entries per token]" in line for line in said[0])
    assert chooser.report() == []


def test_the_cpu_without_kernels_asks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer((1.0, 2.0))
    chooser = install(monkeypatch, timer)
    codes, weight, values, grad = operands()
    sparse_decode.token_sums(codes, weight, values)
    sparse_decode.entry_dots(codes, grad, weight)
    assert timer.calls == 0 and chooser.choices == {} and chooser.report() == []


# --- the benchmark's chooser table -------------------------------------------------------------------------------
def test_the_benchmark_table_says_what_was_picked(kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """`benchmarks/sparse_kernels.py`'s chooser table, run on the CPU with the stand-in kernels (the real one
    needs CUDA): a row per product and one for the whole forward and backward, each with both measured times."""
    from benchmarks import sparse_kernels

    install(monkeypatch, FakeTimer((1e-3, 2e-3), (2e-3, 1e-3)))
    args = sparse_kernels.parse_args(["--dry-run"])
    lines = sparse_kernels.chooser_rows(args, torch.device("cpu"), torch.float32)
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows) == ["decode", "dW_dec", "dW_enc", "dvalues", "encode+decode fwd+bwd"]
    assert rows["decode"][1:4] == ["Triton", "1.000 ms", "2.000 ms"]
    assert all(rows[name][1:4] == ["cuBLAS", "2.000 ms", "1.000 ms"] for name in ("dW_dec", "dW_enc", "dvalues"))
    assert rows["encode+decode fwd+bwd"][1:4] == ["per product", "—", "—"]
    for cells in rows.values():
        assert len(cells) == 8 and all(cell.endswith(" ms") for cell in cells[4:7]) and cells[7].endswith("x")


# --- the real kernels, under Triton's interpreter ------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter (torch import) and the Triton interpreter: ~20 s
def test_kernels_and_cublas_forms_agree_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.product_choice_checks"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    checked = result.stdout.split("checked:")[-1].split()
    assert len(checked) == 6 and "chooser" in checked and "step-topk" in checked, result.stdout
