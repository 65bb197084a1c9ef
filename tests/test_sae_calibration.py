"""First-batch calibration (ReLU's ``initial_l0``, JumpReLU's θ) and per-parameter learning rates (JumpReLU's
``threshold_lr_scale``): each against a plain re-derivation, in one process and across two gloo ranks."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.vit_like_tokens import vit_like_tokens
from sae_pipeline.sae import JumpReLUSAE, ReLUSAE, TopKSAE
from sae_pipeline.sae.calibration import per_latent_cut, pooled_cut
from sae_pipeline.training.optim import param_groups

D, P, L0 = 32, 256, 16


def tokens(n: int = 1024, seed: int = 0) -> torch.Tensor:
    x = torch.from_numpy(vit_like_tokens(n, D, seed=seed))
    return x * math.sqrt(D / float((x**2).sum(1).mean()))


def relu(**kwargs: object) -> ReLUSAE:
    """With ``b_pre`` at the data mean, as SAEModule sets it before the first batch."""
    torch.manual_seed(0)
    sae = ReLUSAE(D, P, l1_coefficient=1e-2, **kwargs)
    sae.init_b_pre(tokens().mean(0))
    return sae


def test_cuts_match_a_plain_sort() -> None:
    pre = torch.randn(300, 40, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3, 40)
    cut = per_latent_cut(pre, 4.0)  # each column: 300 * 4/40 = 30 tokens above the cut
    reference = np.sort(pre.numpy(), axis=0)[300 - 30 - 1]
    np.testing.assert_array_equal(cut.numpy(), reference)
    assert ((pre > cut).sum(0) == 30).all()
    pooled = float(pooled_cut(pre, 4.0))
    assert pooled == pytest.approx(float(np.quantile(pre.numpy(), 0.9)), rel=1e-6)
    assert float((pre > pooled).sum(1).float().mean()) == pytest.approx(4.0, abs=0.01)


def test_relu_initial_l0_sets_b_enc_on_the_first_training_batch_only() -> None:
    x = tokens()
    sae = relu(initial_l0=L0)
    sae.eval()
    sae(x)  # evaluation does not calibrate
    assert not sae.b_enc.any()
    sae.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = sae(x)
    fired = (first.codes != 0).float()
    assert float(fired.sum(1).mean()) == pytest.approx(L0, rel=0.05)  # mean L0 = initial_l0 on that batch
    per_latent = fired.sum(0)  # every latent fires on ~L0/P of the tokens: none starts dead or on half of them
    assert per_latent.min() >= 0.5 * len(x) * L0 / P and per_latent.max() <= 1.5 * len(x) * L0 / P
    b_enc = sae.b_enc.detach().clone()
    sae(tokens(seed=1))
    assert torch.equal(sae.b_enc, b_enc)  # once
    loaded = relu(initial_l0=L0)
    loaded.load_state_dict(sae.state_dict())
    loaded.train()(x)
    assert torch.equal(loaded.b_enc, b_enc)  # a loaded or resumed model keeps its biases
    plain = relu().train()
    plain(x)
    assert not plain.b_enc.any() and float((plain(x).codes != 0).sum(1).float().mean()) > 4 * L0  # the default


@pytest.mark.parametrize("kwargs", [{"initial_l0": 0}, {"initial_l0": P + 1}, {"initial_l0": float("nan")}])
def test_relu_rejects_an_impossible_initial_l0(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="initial_l0"):
        relu(**kwargs)


def test_threshold_lr_scale_is_adams_step_size_for_log_theta() -> None:
    """Adam's first step moves every parameter by its group's lr (times the sign of its gradient)."""
    lr = 1e-3
    steps = {}
    for scale in (1.0, 50.0):
        torch.manual_seed(0)
        sae = JumpReLUSAE(D, P, initial_threshold=0.5, bandwidth=2.0, threshold_lr_scale=scale)
        groups = param_groups(sae, lr)
        assert len(groups) == (1 if scale == 1.0 else 2)  # one group as before: old checkpoints resume
        optimizer = torch.optim.Adam(groups)
        before = {name: p.detach().clone() for name, p in sae.named_parameters()}
        x = tokens(256)
        output = sae(x)
        sae.loss(x, output).loss.backward()
        optimizer.step()
        steps[scale] = {name: (p.detach() - before[name]).abs() for name, p in sae.named_parameters()}
        moved = steps[scale]["log_threshold"][sae.log_threshold.grad != 0]
        assert moved.numel() > 0
        torch.testing.assert_close(moved, torch.full_like(moved, lr * scale), rtol=1e-2, atol=0)
    torch.testing.assert_close(steps[1.0]["W_enc"], steps[50.0]["W_enc"])  # the rest trains as before


def test_param_groups_refuse_a_scale_for_a_parameter_the_sae_does_not_have(monkeypatch: pytest.MonkeyPatch) -> None:
    sae = TopKSAE(D, P, k=4)
    assert len(param_groups(sae, 1e-3)) == 1
    monkeypatch.setattr(sae, "lr_scales", lambda: {"log_threshold": 10.0})
    with pytest.raises(ValueError, match=r"lr_scales names \['log_threshold'\]"):
        param_groups(sae, 1e-3)
    with pytest.raises(ValueError, match="threshold_lr_scale"):
        JumpReLUSAE(D, P, threshold_lr_scale=0.0)


def calibrate_on_rank(rank: int, init_file: str, out_dpath: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        x = tokens(seed=rank)  # each rank its own batch
        saes = {"relu": relu(initial_l0=L0), "jumprelu": JumpReLUSAE(D, P, sparsity_loss="target_l0", target_l0=L0)}
        for name, sae in saes.items():
            sae.train()(x)
            torch.save({"state": sae.state_dict(), "own": own_cut(name, sae, x)}, f"{out_dpath}/{name}_{rank}.pt")
    finally:
        dist.destroy_process_group()


def own_cut(name: str, sae: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What this rank alone would have set: ReLU's per-latent cut, JumpReLU's pooled cut."""
    with torch.no_grad():
        pre = (x - sae.b_pre) @ sae.W_enc
    return per_latent_cut(pre, L0) if name == "relu" else pooled_cut(pre, L0)


def test_calibration_is_the_mean_over_two_gloo_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # for the two children only: later tests' jobs inherit os.environ
    mp.start_processes(calibrate_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn")
    for name, value_of in (("relu", lambda s: -s["b_enc"]), ("jumprelu", lambda s: s["log_threshold"].exp())):
        ranks = [torch.load(tmp_path / f"{name}_{r}.pt", weights_only=True) for r in range(2)]
        assert torch.equal(ranks[0]["state"]["b_enc"], ranks[1]["state"]["b_enc"])  # the replicas agree
        assert torch.equal(ranks[0]["state"]["W_enc"], ranks[1]["state"]["W_enc"])
        mean = (ranks[0]["own"] + ranks[1]["own"]) / 2
        assert not torch.allclose(ranks[0]["own"], ranks[1]["own"])  # the batches differed
        value = value_of(ranks[0]["state"])  # [P]; JumpReLU's θ is one value for all latents
        torch.testing.assert_close(value, mean.expand_as(value), rtol=1e-5, atol=1e-6)
