"""The whole training step as one CUDA graph, replayed inside Lightning's loop.

Why: at the paper's shapes a sync-free step is a few hundred small kernels whose launches cost as
much host time as the GPU spends on them, and Lightning's per-step host work (hooks, progress bar,
logging) adds to it. Captured once, the step (forward, loss, backward, the parallel-gradient
removal, Adam, the unit-norm projection, the dead-latent clock, the NaN/Inf watch) is one launch, and
the host runs ahead of the GPU instead of feeding it kernel by kernel.

What a graph needs, and how the module gives it:

- Fixed addresses: each batch is copied into one input buffer (`StaticStep.x`), the global step into
  a device scalar; the step's outputs (loss terms, reconstruction, codes) are the tensors the capture
  allocated, rewritten by each replay and read on logging steps only.
- No host value baked in that changes: Adam runs with ``capturable=True`` and its learning rate as a
  device tensor, which Lightning's scheduler fills in place between replays (`prepare_optimizer`); a
  variant whose loss changes with the step on the host (ReLU's L1 warm-up,
  `SparseAutoencoder.step_dependent`) runs eagerly until it stops changing.
- The same tensors as eager training: the parameters and Adam's moments are updated in place, so the
  checkpoint Lightning writes is the one an eager run writes (`checkpoint_groups` puts the learning rate
  back as a number).
- A few eager steps first, on a side stream (PyTorch's rule: lazy state such as Adam's moments and
  cuBLAS workspaces must exist before capture), then capture, then one replay per step.
- A host value that does change the step's work is a key (`SparseAutoencoder.plan_step`: TopK's AuxK
  slots, from a dead count the host knows a few steps late, 0 while no latent is dead): one graph per
  key, sharing one memory pool, each captured the first time its key comes (after one eager step of it)
  and replayed for every later step of that key (`StaticStep`).

Where capture is impossible the step runs eagerly and the module says why once: not CUDA, DDP (the
gradient all-reduce runs outside the step), gradient accumulation or the Trainer's gradient clipping
(applied between backward and Adam by Lightning), fp16's gradient scaler (it reads the device), a
forced ``sync_free=False``, a batch of another shape (the last, partial batch: that step only), or a
capture that failed. `StaticStep.run` also runs without capture (``capture=False``), so the CPU tests
check the captured callable against the module's eager step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

#: The `SAEModule` a step belongs to; not imported, since module.py imports this file (no cycle).
SAEModule = Any

#: Devices where the step is captured (the CPU tests add "cpu" to run `StaticStep` without capture).
CAPTURE_DEVICES: tuple[str, ...] = ("cuda",)
#: Eager steps on a side stream before the capture.
WARMUP_STEPS = 3


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Make Adam capturable in place: ``capturable=True``, each group's learning rate a tensor on its
    parameters' device (the scheduler then fills it, no recapture), the step counters on that device."""
    optimizer.defaults["capturable"] = True
    for group in optimizer.param_groups:
        device = group["params"][0].device
        group["capturable"] = True
        if not isinstance(group["lr"], Tensor):
            # CUDA's fused Adam reads a float32 learning rate (rounded at ~1e-8); elsewhere the exact value
            dtype = torch.float32 if device.type == "cuda" else torch.float64
            group["lr"] = torch.full((), float(group["lr"]), dtype=dtype, device=device)  # a fill, not a copy
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state:
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def checkpoint_groups(optimizer_state: dict[str, Any]) -> None:
    """A saved optimizer state as an eager run saves it: numbers for learning rates, ``capturable`` off
    (a graph run prepares the optimizer again after it resumes; an eager or CPU run loads it as is)."""
    for group in optimizer_state.get("param_groups", []):
        if isinstance(group.get("lr"), Tensor):
            group["lr"] = float(group["lr"])
        if "capturable" in group:
            group["capturable"] = False


class StaticStep:
    """One optimiser step of ``module`` on fixed buffers: captured as a CUDA graph and replayed on
    CUDA; run eagerly (the same code) when ``capture`` is False.

    One graph per step key (`SparseAutoencoder.plan_step`: what the step's work depends on that the host
    knows, e.g. TopK's AuxK slots, 0 while no latent is dead), each replayed for the steps of its key. A key
    seen for the first time costs one eager step (on the side stream: PyTorch's warm-up before a capture,
    here for the key's new shapes and kernels) and one capture; a key seen before costs nothing, so a
    flip of the key costs at most a capture. The first capture also waits for `WARMUP_STEPS` eager steps.

    The graphs share one memory pool, which is safe in any order of replays: what a capture allocates is
    its step's temporaries (gradients included: each step sets them to None first) and its outputs, read
    only after a replay of the same graph; the state carried from step to step (parameters, Adam's
    moments, buffers, the input and step buffers) is allocated outside the captures and updated in place.
    """

    def __init__(self, module: SAEModule, optimizer: torch.optim.Optimizer, capture: bool) -> None:
        self.module, self.optimizer, self.capture = module, optimizer, capture
        self.x: Tensor | None = None  # the input buffer, [B, d_in] of the first batch
        self.batch: dict[str, Any] = {}
        self.step: Tensor | None = None  # the global step, int64 on the device
        self.outputs: tuple[Tensor, Any, Any] | None = None
        self.graphs: dict[Hashable, Any] = {}  # step key -> torch.cuda.CUDAGraph
        self.graph_outputs: dict[Hashable, tuple[Tensor, Any, Any]] = {}  # each graph's outputs
        self.graph: Any = None  # the graph replayed last (None before the first capture)
        self.pool: Any = None  # the graphs' shared memory pool
        self.warmed: set[Hashable] = set()  # keys that ran eagerly (a capture of a new key waits for one)
        self.capturing = False  # a capture under way (its failure is not the step's)
        self.eager_runs = 0  # warm-up runs before a capture
        self.runs = 0
        self.key_runs: Counter[Hashable] = Counter()  # runs per key
        prepare_optimizer(optimizer)

    def fits(self, x: Tensor) -> bool:
        """Whether ``x`` can go through the buffers (same shape, dtype and device as the first batch)."""
        return self.x is None or (x.shape == self.x.shape and x.dtype == self.x.dtype and x.device == self.x.device)

    def action(self, key: Hashable) -> str:
        """What a run of ``key`` does: ``"replay"`` its graph, ``"capture"`` it (then replay), or ``"eager"``
        (a warm-up: before the first capture, `WARMUP_STEPS` steps; before a new key's, one of that key)."""
        if key in self.graphs:
            return "replay"
        if self.eager_runs < WARMUP_STEPS or key not in self.warmed:
            return "eager"
        return "capture"

    def run(self, batch: dict[str, Any], step: int, key: Hashable = None) -> tuple[Tensor, Any, Any]:
        """The step on ``batch`` at global step ``step``, whose work is ``key``'s (`SparseAutoencoder.plan_step`,
        called just before): ``(x as the SAE saw it, SAEOutput, SAELoss)``, valid until the next run (the
        batch's other keys, such as its shards, serve an eager run's error messages)."""
        x = batch["x"]
        self.runs += 1
        self.key_runs[key] += 1
        if self.x is None or self.step is None:
            self.x = torch.empty_like(x)
            self.step = torch.zeros((), dtype=torch.int64, device=x.device)
        self.x.copy_(x)
        self.batch = {**batch, "x": self.x}
        self.step.fill_(step)
        action = self.action(key)
        if not self.capture:
            self.outputs = self._step()
        elif action == "eager":
            self.outputs = self._warm_up()
            self.eager_runs += 1
            self.warmed.add(key)
        else:
            if action == "capture":
                self.capturing = True
                self.graphs[key], self.graph_outputs[key] = self._capture()
                self.capturing = False
            self.graph, self.outputs = self.graphs[key], self.graph_outputs[key]
            self.graph.replay()
        assert self.outputs is not None
        x_seen, output, losses = self.outputs
        if output.sparse is not None:
            output._codes = None  # dense codes built from an earlier run's sparse ones would be stale
        return x_seen, output, losses

    def _warm_up(self) -> tuple[Tensor, Any, Any]:
        """The step run eagerly on a side stream (before a capture), ordered with the current stream."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = self._step()
        torch.cuda.current_stream().wait_stream(side)
        return outputs

    def _capture(self) -> tuple[Any, tuple[Tensor, Any, Any]]:
        """The step captured (not run) into a new graph in the shared pool: ``(graph, its outputs)``."""
        graph = torch.cuda.CUDAGraph()
        device_type = "cuda"
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # Autocast's cache of cast weights must not outlive the capture (PyTorch's rule for graphs).
        autocast = torch.autocast(
            device_type,
            dtype=torch.get_autocast_dtype(device_type),
            enabled=torch.is_autocast_enabled(device_type),
            cache_enabled=False,
        )
        # thread_local: the data loader's pin-memory thread may allocate host memory during the capture
        with autocast, torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self._step()
        return graph, outputs

    def _step(self) -> tuple[Tensor, Any, Any]:
        """What Lightning's eager step does, in its order of effects: forward and loss (the firing clock and
        the NaN/Inf watch advanced), backward, parallel-gradient removal, Adam, unit-norm atoms."""
        assert self.x is not None and self.step is not None
        module = self.module
        self.optimizer.zero_grad(set_to_none=True)  # gradients allocated by the step itself (in the graph's pool)
        with torch.enable_grad():
            x, output, losses = module.step_loss(self.batch, static_step=self.step)
            losses.loss.backward()
        module.sae.remove_parallel_grad()
        self.optimizer.step()
        module.sae.normalize_atoms()
        return x, output, losses


class CudaGraphStep:
    """The module's choice, step by step, between the `StaticStep` and Lightning's eager step, and the
    one line saying why a step is not captured (each reason once per run)."""

    def __init__(self, option: bool | None) -> None:
        self.option = option
        self.static: StaticStep | None = None
        self.said: set[str] = set()
        self.failed: str | None = None

    def use_for(self, module: SAEModule, batch: dict[str, Any]) -> bool:
        """Whether this batch's step goes through the `StaticStep` (False: Lightning's eager step)."""
        if self.option is False:
            return False
        reason = self.failed or run_blocker(module)
        if reason is not None:
            if module.device.type in CAPTURE_DEVICES or self.option:
                self.say(f"the training step runs eagerly, not as a CUDA graph: {reason}")
            return False
        optimizer = module.trainer.optimizers[0]
        if self.static is None or self.static.optimizer is not optimizer:  # a new fit (or a restored one)
            self.static = StaticStep(module, optimizer, capture=module.device.type == "cuda")
        x = batch["x"]
        if not self.static.fits(x):
            shape = list(self.static.x.shape) if self.static.x is not None else []
            self.say(f"a batch of shape {list(x.shape)} ({x.dtype}) is not the captured {shape}: eager steps for it")
            return False
        step = module.global_step
        if module.sae.step_dependent(step):
            self.say(f"{type(module.sae).__name__}'s loss changes with the step (a warm-up): eager steps until it ends")
            return False
        return True

    def run(self, module: SAEModule, batch: dict[str, Any], key: Hashable = None) -> tuple[Tensor, Any, Any]:
        """The step through the `StaticStep`, with the step's key (`SparseAutoencoder.plan_step`). Where a
        capture fails, this step runs the same code eagerly and every later one takes Lightning's eager step."""
        static = self.static
        assert static is not None
        try:
            return static.run(batch, module.global_step, key)
        except RuntimeError as exn:  # torch.AcceleratorError (a CUDA error) included
            if not static.capturing:
                raise  # not a capture: a real error of the step
            self.failed = f"capture failed ({str(exn).splitlines()[0] if str(exn) else type(exn).__name__})"
            self.say(f"the training step runs eagerly, not as a CUDA graph: {self.failed}", force_warning=True)
            self.static = None
            static.capture, static.capturing, static.graph, static.graphs = False, False, None, {}
            return static.run(batch, module.global_step, key)

    def say(self, line: str, force_warning: bool = False) -> None:
        if line in self.said:
            return
        self.said.add(line)
        if self.option or force_warning:
            rank_zero_warn(line)
        else:
            rank_zero_info(line)


def run_blocker(module: SAEModule) -> str | None:
    """Why this run's step cannot be captured (None: it can)."""
    trainer = module.trainer
    if module.device.type not in CAPTURE_DEVICES:
        return f"the device is {module.device.type}, not CUDA"
    if trainer.world_size > 1:
        return "DDP (the gradient all-reduce runs outside the step)"
    if trainer.accumulate_grad_batches != 1:
        return "--trainer.accumulate_grad_batches is not 1"
    if trainer.gradient_clip_val:
        return "--trainer.gradient_clip_val is set (Lightning clips between backward and Adam)"
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return "16-mixed precision (its gradient scaler reads the device every step)"
    if not module.sae.avoids_host_reads(module.sae.W_dec):
        return "model.sae.sync_free is False (the step reads device values on the host)"
    if len(trainer.optimizers) != 1 or not isinstance(trainer.optimizers[0], torch.optim.Adam):
        return "the optimizer is not the module's Adam"
    return None
