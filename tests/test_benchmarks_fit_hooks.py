"""The benchmarks' hand-written training loops call the SAE's host-side hooks where ``SAEModule`` calls them
(benchmarks/fit_hooks.py): ``begin_fit`` once, ``plan_step`` before and ``after_step`` after every step, so that on
a GPU they time TopK's planned AuxK (nothing while no latent is dead), not the masked AuxK over every latent.

Checked on the CPU with the GPU's code (``sync_free=True``) on a TopK of 64 latents: the calls counted; the bare
loop of benchmarks/train_step.py ends with the same SAE as ``SAEModule`` in a ``Trainer`` over the same batches,
latents dying and AuxK planned on the way; the steps of benchmarks/gpu.py and of our contender in
benchmarks/peers.py (the same work, constant learning rate) end with the same SAE, AuxK planned from their
first step when latents are dead at the start."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Hashable

import torch

from benchmarks import gpu, train_step
from benchmarks.peer_adapters import Ours
from benchmarks.scaling import points
from sae_pipeline.sae import TopKSAE
from sae_pipeline.sae.topk import aux_slots

D_IN, D_SAE, K = 16, 64, 4
HOOKS = ("begin_fit", "plan_step", "after_step")


def counted(sae: TopKSAE) -> dict[str, list[Hashable]]:
    """Wraps the SAE's hooks (on this instance) to record each call's result, by hook."""
    calls: dict[str, list[Hashable]] = {name: [] for name in HOOKS}
    for name in HOOKS:
        hook = getattr(sae, name)

        def record(hook=hook, name=name) -> Hashable:  # noqa: ANN001
            result = hook()
            calls[name].append(result)
            return result

        object.__setattr__(sae, name, record)
    return calls


def gpu_code_topk(dead_after_tokens: int = 10_000_000, n_dead: int = 0) -> TopKSAE:
    """A TopK on the GPU's code (no host read in the step), its late dead count two steps late."""
    torch.manual_seed(0)
    sae = TopKSAE(D_IN, D_SAE, k=K, dead_after_tokens=dead_after_tokens)
    sae.sync_free, sae.aux_lag = True, 2
    with torch.no_grad():
        sae.tokens_since_fired[:n_dead] = dead_after_tokens
    return sae


def test_the_bare_loop_calls_the_hooks_and_ends_as_the_module() -> None:
    args = train_step.parse_args(
        ["--d-in", str(D_IN), "--d-sae", str(D_SAE), "--batch-size", "16", "--k", str(K), "--steps", "10"]
        + ["--warmup", "2", "--warmup-lr-steps", "3", "--log-every", "4", "--n-distinct-batches", "3"]
    )
    device = torch.device("cpu")
    batches = train_step.make_batches(args, device)
    template = gpu_code_topk(dead_after_tokens=32)  # a latent silent for 2 steps of 16 tokens is dead
    bare, module = copy.deepcopy(template), copy.deepcopy(template)
    bare_calls, module_calls = counted(bare), counted(module)
    train_step.bare_steps(bare, batches, args, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on loaders and workers
        train_step.lightning_steps(module, batches, args, device)
    total = args.warmup + args.steps
    assert [len(bare_calls[name]) for name in HOOKS] == [1, total, total]
    assert bare_calls == module_calls  # the same calls, the same plans
    assert any(slots for slots in bare_calls["plan_step"]), bare_calls  # latents died: AuxK was planned
    assert bool(bare.dead_mask().any())
    for name, value in module.state_dict().items():
        torch.testing.assert_close(bare.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_gpu_and_peers_steps_call_the_hooks_and_agree() -> None:
    torch.manual_seed(1)
    x = torch.randn(32, D_IN) + 0.5
    template = gpu_code_topk(n_dead=8)  # 8 latents dead when the fit begins
    template.init_b_pre(x.mean(0))
    gpu_sae = copy.deepcopy(template)
    gpu_calls = counted(gpu_sae)
    step, hooks = gpu.training_step(gpu_sae, x, autocast=False)
    ours = Ours("topk", template, 32, K)  # builds its own copy; its hooks start there
    for _ in range(3):
        step()
        ours.step(x)
    assert hooks.steps == ours.hooks.steps == 3
    assert [len(gpu_calls[name]) for name in HOOKS] == [1, 3, 3]
    assert gpu_calls["plan_step"] == [aux_slots(8, D_SAE)] * 3  # AuxK over the 8 dead latents from the first step
    assert ours.hooks.key == aux_slots(8, D_SAE)
    for name, value in gpu_sae.state_dict().items():
        torch.testing.assert_close(ours.model.state_dict()[name], value, msg=name)


def test_the_scaling_step_calls_the_hooks() -> None:
    sae = gpu_code_topk(n_dead=4)
    calls = counted(sae)
    batches = [torch.randn(16, D_IN), torch.randn(16, D_IN)]
    points.step_durations(sae, batches, warmup=1, steps=2)
    assert [len(calls[name]) for name in HOOKS] == [1, 3, 3] and calls["plan_step"][0] == aux_slots(4, D_SAE)
