"""The sparse products on both paths of the chooser (`sae_pipeline/sae/product_choice.py`), the real Triton
kernels under Triton's interpreter against the cuBLAS forms and float64 references, for a process started with
``TRITON_INTERPRET=1`` (`tests/test_product_choice.py` runs ``python -m tests.product_choice_checks``; Triton
reads the variable when it is first imported). CPU tensors stand in for CUDA ones: `sparse_decode._gpu_kernels`
is pointed at `triton_sparse` for them."""

from __future__ import annotations

import copy
import types

import torch

from sae_pipeline.sae import TopKSAE, product_choice, sparse_decode
from sae_pipeline.sae.product_choice import DENSE, SPARSE, ProductChooser
from tests.sparse_kernel_checks import TOLERANCE, ragged_codes, relative_error, topk_codes

#: The interpreted kernels' calls, by name: the sparse side must have run them, not a fallback.
CALLS: list[str] = []


def use_interpreted_kernels() -> None:
    from sae_pipeline.sae import triton_sparse

    def counted(name: str) -> object:
        def call(*args: object, **kwargs: object) -> object:
            CALLS.append(name)
            return getattr(triton_sparse, name)(*args, **kwargs)

        return call

    counting = types.SimpleNamespace(segment_sums=counted("segment_sums"), entry_dots=counted("entry_dots"))

    def kernels(*operands: torch.Tensor) -> object:
        ok = sparse_decode.use_triton and all(t.dtype in triton_sparse.KERNEL_DTYPES for t in operands)
        return counting if ok else None

    sparse_decode._gpu_kernels = kernels


def products(codes: sparse_decode.SparseCodes, d_in: int, dtype: torch.dtype, seed: int) -> list[str]:
    """Each product forced onto each path, on fresh random operands of ``dtype``, against float64."""
    g = torch.Generator().manual_seed(seed)
    batch, d_sae, nnz = codes.batch_size, codes.d_sae, codes.indices.numel()
    W_dec = torch.randn(d_sae, d_in, generator=g).to(dtype)
    W_enc = torch.randn(d_in, d_sae, generator=g).to(dtype)
    tokens = torch.randn(batch, d_in, generator=g).to(dtype)
    values = torch.randn(nnz, generator=g).to(dtype)
    dense = torch.zeros(batch, d_sae, dtype=torch.float64).index_put(
        (codes.rows, codes.indices), values.double(), accumulate=True
    )
    reference = {
        "decode": dense @ W_dec.double(),
        "dW_dec": dense.T @ tokens.double(),
        "dvalues": (tokens.double() @ W_dec.double().T)[codes.rows, codes.indices],
        "dx": dense @ W_enc.double().T,
    }
    for path in (SPARSE, DENSE):
        CALLS.clear()
        with product_choice.CHOOSER.forcing(path):
            got = {
                "decode": sparse_decode.token_sums(codes, W_dec, values),
                "dW_dec": sparse_decode.latent_sums(codes, tokens, values),
                "dvalues": sparse_decode.entry_dots(codes, tokens, W_dec),
                "dx": sparse_decode.token_sums(codes, W_enc.T, values, "dx"),
            }
        expected = ["segment_sums", "segment_sums", "entry_dots", "segment_sums"] if path == SPARSE else []
        assert CALLS == expected, (path, CALLS)
        for name, ref in reference.items():
            error = relative_error(got[name], ref)
            assert got[name].dtype == dtype and error <= TOLERANCE[dtype], (path, name, dtype, error)
    return [f"{dtype}".removeprefix("torch.")]


def chooser_runs_what_it_picked() -> str:
    """The chooser itself, with fixed timings: the kernel when it is faster, cuBLAS when that is, same sums."""
    codes = topk_codes(16, 64, 4, torch.Generator().manual_seed(3), "cpu")
    W_dec, values = torch.randn(64, 32), torch.randn(codes.indices.numel())
    reference = codes.with_values(values.double()).to_dense() @ W_dec.double()
    for timings, path in (((1.0, 2.0), SPARSE), ((2.0, 1.0), DENSE)):
        chooser = product_choice.CHOOSER = ProductChooser(timer=lambda s, d, device, t=timings: t)
        CALLS.clear()
        out = sparse_decode.token_sums(codes, W_dec, values)
        assert [choice.path for choice in chooser.choices.values()] == [path]
        assert CALLS == (["segment_sums"] if path == SPARSE else []), (path, CALLS)
        assert relative_error(out, reference) <= TOLERANCE[torch.float32], path
    return "chooser"


def topk_step_on_both_paths() -> str:
    """A TopK SAE's step (float32) with every product on the interpreted kernels, then on cuBLAS: the same loss
    and gradients to float32 rounding."""
    torch.manual_seed(0)
    template = TopKSAE(32, 256, k=4)
    template.sparse_max_density = 1.0
    x = torch.randn(16, 32)
    grads = []
    for path in (SPARSE, DENSE):
        sae = copy.deepcopy(template)
        CALLS.clear()
        with product_choice.CHOOSER.forcing(path):
            out = sae(x)
            assert out.sparse is not None
            sae.loss(x, out).loss.backward()
        assert len(CALLS) == (4 if path == SPARSE else 0), (path, CALLS)  # decode, ∂values, ∂W_dec, ∂W_enc
        grads.append({name: p.grad for name, p in sae.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    return "step-topk"


def interpreted_choice_checks() -> list[str]:
    use_interpreted_kernels()
    done = []
    for layout, make in (("topk", topk_codes), ("ragged", ragged_codes)):
        for dtype in (torch.float32, torch.bfloat16):
            codes = make(16, 64, 4, torch.Generator().manual_seed(0), "cpu")
            done += [f"{layout}-{name}" for name in products(codes, 32, dtype, seed=7)]
    done += [chooser_runs_what_it_picked(), topk_step_on_both_paths()]
    assert sparse_decode.use_triton, "a kernel failed in the interpreter (see the warning)"
    return done


if __name__ == "__main__":
    print("checked:", " ".join(interpreted_choice_checks()))
