"""NTK-FL (Yue, Jin, Pilgrim, Wong, Baron & Dai, ICML 2022, "Neural Tangent Kernel Empowered
Federated Learning", Section 4.1 and Figure 1): clients upload per-sample Jacobians instead of
models; the server evolves the global model in closed form.

Round k, participants C_k (the run's ``clients_per_round``; the paper: 20 of 300):

1. each participant m computes, at the broadcast weights w⁽ᵏ⁾, its Jacobian tensor J_m (N_m × C × d)
   of all C outputs w.r.t. all d parameters (:func:`hpcfl.entk.jacobian.per_sample_jacobian`, the
   fused outer-product path for Linear/ReLU models), its outputs f⁽ᵏ⁾(X_m) and labels Y_m, and
   uploads them as GATHERED objects (no summed vector): every rank receives every participant's
   rows (an allgather; a ring would move the same N·C·d entries per rank, in more steps, so the
   runner's one allgather is kept);
2. every rank computes its share of the kernel blocks H_ml = (1/C)⟨J_m, J_l⟩ and one reduce sums
   H (:func:`hpcfl.ntk.evolution.kernel`); rank 0 computes the function-space evolution at every t of
   the grid {t₁…t_Ψ} (default: the reference code's cross-entropy evolution as gradient descent on
   the linearised model; the paper's MSE analysis in closed form as an option);
3. rank 0 also computes the weight update Δw(t) = −(η/(N·κ)) Σ_m J_mᵀ S_m(t), S the residuals' sum
   (or integral, ``flow``) (Eqs. 9b, 10; κ = C for MSE, 1 for cross entropy), for every grid
   point, and ONE reduce shares evolution and update (:meth:`NTKFL.shared_step`): the other ranks
   add zeros, so every rank holds the same bits whatever their number (a per-rank share of the
   update summed by the reduce would round differently on 2 and 3 ranks), and no rank repeats the
   evolution; the update's products cost ~1/20 of the cross-entropy evolution's at the paper's
   setup, so little parallelism is lost;
4. t* = argmin_t of the training loss of the REAL network at w⁽ᵏ⁾ + Δw(t) on the round's samples
   (Eq. 11a), all candidates in one batched (vmapped) pass, and w⁽ᵏ⁺¹⁾ = w⁽ᵏ⁾ + Δw(t*).

Eq. 11a evaluates the network on the round's training inputs X⁽ᵏ⁾, which this simulation's server
receives beside the Jacobians (``select: train``; they are counted in ``bytes_up``, ~0.1 % of the
Jacobians for the MLP; a deployment would instead broadcast the Ψ candidates and collect Ψ losses).
``select: kernel`` chooses t* by the loss of the closed-form f⁽ᵗ⁾ instead, so nothing but J, f and
Y leaves a client (with MSE it then picks the largest t of the grid, since the kernel flow decreases
the loss monotonically). ``select: validation`` (Section 4.1: "a validation dataset ... obtained
from held-out clients") holds ``validation_clients`` clients out of training for the whole run (a
seeded draw) and picks t* by the real network's loss on their data, which the server holds.
Metrics: ``t_star``, the selected loss, ``evolve_steps`` (products of H the evolution took) and
``evolve_dt`` (its step), ``kernel_cond`` (λ_max/λ_min of H) only with ``params.kernel_cond``, and
the server step's time split; ``bytes_up`` counts the gathered tensors as sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    Exchange,
    HyperParams,
    ServerContext,
    ServerState,
    Stage,
    Upload,
)
from hpcfl.algorithms.participation import Population
from hpcfl.entk._common import eval_mode
from hpcfl.entk.jacobian import (
    JACOBIAN_METHODS,
    JacobianMethod,
    factored_jacobian,
    fusable,
    per_sample_jacobian,
)
from hpcfl.errors import ConfigError, DivergenceError
from hpcfl.ntk.evolution import Jacobian, Rows, condition, evolve, kernel, weight_updates
from hpcfl.ntk.product import PRECISIONS, resolve_precision

UPLOADS = ("auto", "dense", "factored")


def _choice(key: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"config key 'params.{key}' must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class NTKFLParams(HyperParams):
    """NTK-FL's server evolution (Yue et al., ICML 2022, Section 4.1 and Section 6).

    - ``eta`` η = 0.01: the evolution's learning rate, the reference code's (``utils/config_fmnist.yaml``);
      the paper searches {1e-3, 3e-3, 1e-2, 3e-2, 1e-1} (Appendix A) and keeps it fixed;
    - ``grid`` {t₁…t_Ψ} = {100, 200, …, 1000, 1500, 2000}: the reference code's 12 candidate step
      counts (Section 6);
    - ``loss``: ``ce`` (default, the reference code's cross-entropy evolution; its weight update is
      −(η/N) Σ Jᵀ S, without the MSE's 1/C, as in the reference code) or ``mse`` (the paper's
      analysis, closed form on the update's time scale η·t/(N·C));
    - ``evolution``: ``discrete`` (default: gradient descent on the linearised model, step 1, exact;
      one product of H per step for ``ce``) or ``flow`` (the continuous gradient flow: closed form for
      ``mse``, RK4 for ``ce`` to :data:`hpcfl.ntk.evolution.RK4_TOLERANCE`, the reference code's
      dopri5 replaced by stability-limited fixed steps, ~3× the products of ``discrete``);
      see :mod:`hpcfl.ntk.evolution`;
    - ``ce_dt``: the cross-entropy flow's largest RK4 step (``evolution: flow``); a step past the
      stability limit h·η·ρ/(2N) ≤ 2 is split into shorter equal steps, the step taken reported as
      the metric ``evolve_dt`` (``discrete`` always takes steps of 1);
    - ``kernel_product``: how the cross-entropy evolution multiplies by H, its whole cost:
      ``auto`` (default: float64 for a float64 model, deflated int8 limbs on a CPU from 1,024 rows,
      float32 otherwise), ``float64``, ``float32`` or ``int8`` (:mod:`hpcfl.ntk.product`: the int8
      product is exact integer arithmetic on two limbs per entry, within
      :data:`hpcfl.ntk.product.INT8_TOLERANCE` of the float64 evolution, 3.7× faster than a float32
      product at the paper's setup); the metric ``evolve_product`` names the one used;
    - ``kernel_cond``: also report λ_max/λ_min of H (``kernel_cond``, ``kernel_lambda_max``): an
      ``eigvalsh`` of the N × N kernel, done once on rank 0, so off by default (the MSE evolution's
      eigendecomposition supplies it for free);
    - ``select``: ``train`` (Eq. 11a: the real network's training loss on the round's samples),
      ``kernel`` (the closed-form outputs' loss; no inputs leave the clients) or ``validation``
      (the real network's loss on ``validation_clients`` held-out clients, drawn once from
      ``validation_seed``; they never train);
    - ``jacobian``: ``auto`` | ``fused`` | ``vmap`` (:class:`~hpcfl.entk.jacobian.JacobianMethod`);
    - ``upload``: ``auto`` | ``dense`` | ``factored``: how the Jacobians travel and are held. Dense is
      the paper's N_m × C × d tensor; factored sends the same Jacobian losslessly as each Linear
      layer's inputs and output gradients (:class:`~hpcfl.entk.jacobian.FactoredJacobian`; for the
      MLP-100 ~420× fewer numbers), and the server builds the same kernel and update from the
      factors without expanding them. ``auto``: factored when every parametrised layer is a Linear
      (and, in CP-NTK-FL, nothing is sparsified), dense otherwise;
    - ``memory_budget``: ``auto`` (80 % of this node's available memory over its ranks) or bytes per
      rank; a round that cannot fit is refused before the first round (:mod:`hpcfl.ntk.memory`).
    """

    eta: float = 0.01
    grid: tuple[int, ...] = (*range(100, 1001, 100), 1500, 2000)
    evolution: str = "discrete"
    loss: str = "ce"
    ce_dt: float = 10.0
    kernel_product: str = "auto"
    kernel_cond: bool = False
    select: str = "train"
    validation_clients: int = 0
    validation_seed: int = 0
    jacobian: str = "auto"
    upload: str = "auto"
    memory_budget: str = "auto"

    def __post_init__(self) -> None:
        if not self.eta > 0:
            raise ConfigError(f"config key 'params.eta' must be > 0, got {self.eta}")
        grid = self.grid if isinstance(self.grid, (list, tuple)) else [self.grid]
        try:
            steps = tuple(int(t) for t in grid)
        except (TypeError, ValueError):
            raise ConfigError(
                f"config key 'params.grid' must be a list of step counts, got {self.grid!r}"
            ) from None
        if not steps or any(t < 0 for t in steps) or list(steps) != sorted(set(steps)):
            raise ConfigError(
                f"config key 'params.grid' must be increasing step counts >= 0, got {list(steps)}"
            )
        object.__setattr__(self, "grid", steps)
        _choice("evolution", self.evolution, ("flow", "discrete"))
        _choice("loss", self.loss, ("mse", "ce"))
        _choice("kernel_product", self.kernel_product, PRECISIONS)
        _choice("select", self.select, ("train", "kernel", "validation"))
        if self.validation_clients < 0 or (self.select == "validation") != (self.validation_clients > 0):
            raise ConfigError(
                "config key 'params.validation_clients' must be >= 1 with params.select: validation "
                f"and 0 otherwise, got {self.validation_clients} with select: {self.select}"
            )
        _choice("jacobian", self.jacobian, JACOBIAN_METHODS)
        _choice("upload", self.upload, UPLOADS)
        if self.upload == "factored" and self.jacobian_method is JacobianMethod.VMAP:
            raise ConfigError("config key 'params.upload: factored' needs params.jacobian: auto or fused")
        if not self.ce_dt > 0:
            raise ConfigError(f"config key 'params.ce_dt' must be > 0, got {self.ce_dt}")
        if not isinstance(self.kernel_cond, bool):
            raise ConfigError(
                f"config key 'params.kernel_cond' must be true or false, got {self.kernel_cond!r}"
            )
        if self.memory_budget != "auto":
            from hpcfl.units import parse_memory_budget

            parse_memory_budget(str(self.memory_budget), key="params.memory_budget")

    def entk_method(self) -> str | None:
        """The clients' Jacobian method (``params.jacobian``)."""
        return self.jacobian

    @property
    def jacobian_method(self) -> JacobianMethod:
        """``jacobian`` as the enum (the config keeps the string; validated above)."""
        return JacobianMethod(self.jacobian)


@dataclass
class _Timer:
    """Seconds spent in the server step's parts (reported as metrics, not part of any state)."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, seconds: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + seconds


@dataclass
class SharedStep:
    """What rank 0 computes and shares in one round (:meth:`NTKFL.shared_step`): Δw(t) (Ψ, P) and
    f⁽ᵗ⁾ (Ψ, N, C) at the grid points, the evolution's products of H and step, the spectrum metrics
    (only with ``kernel_cond``) and rank 0's seconds."""

    updates: Tensor
    outputs: Tensor
    steps: int
    dt: float
    spectrum: dict[str, float]
    eigh_s: float
    evolve_s: float
    update_s: float


class NTKFL(Algorithm[NTKFLParams, ServerState, ClientState]):
    """NTK-FL: gathered Jacobians, the kernel evolution on every rank, t* by training loss."""

    name = "ntkfl"
    dp_refusal = "it uploads Jacobians and labels, not a clippable update"
    Params = NTKFLParams
    logs_validation = False  # the evolved model is evaluated on the test set only
    example_params = NTKFLParams(grid=(10, 20))
    unbatched_reason = "its clients compute Jacobians, not local SGD"

    network: nn.Module | None = None  # the model the server evaluates candidates with (attach)
    validation: tuple[Tensor, Tensor] | None = None  # held-out clients' (x, y) (select: validation)

    def attach(self, network: nn.Module, validation: tuple[Tensor, Tensor] | None = None) -> None:
        """The network whose real loss picks t* (the stage plan attaches the run's model) and, for
        ``select: validation``, the held-out clients' samples (x, y)."""
        self.network = network
        self.validation = validation

    def held_out(self, population: Population) -> list[int]:
        """The clients kept out of training to choose t* (``select: validation``), sorted; a pure
        function of the population size and ``validation_seed``."""
        V = self.params.validation_clients
        if V == 0:
            return []
        if V >= population.size:
            raise ConfigError(
                f"params.validation_clients: {V} leaves no client to train among {population.size}"
            )
        seed = np.random.SeedSequence([self.params.validation_seed, 0x7A1]).generate_state(1)[0]
        # host: seeded client ids
        order = torch.randperm(population.size, generator=torch.Generator().manual_seed(int(seed)))
        return sorted(int(k) for k in order[:V])

    def participants(self, rnd: int, population: Population, generator: torch.Generator) -> list[int]:
        """The run's participation rule over the clients that are not held out."""
        held = set(self.held_out(population))
        if not held:
            return super().participants(rnd, population, generator)
        others = [k for k in range(population.size) if k not in held]
        sub = Population(tuple(population.sizes[k] for k in others))
        return [others[i] for i in self.participation.sample(sub, generator)]

    def stages(self) -> Sequence[Stage]:
        return (Stage("train", -1, enter="ntkfl.enter"),)

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        names = ("jacobian", "output", "label") + (("input",) if self.params.select == "train" else ())
        return Exchange(sums=(), gathers=names)

    # -- client ------------------------------------------------------------------------------
    def local_rows(self, data: ClientData, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        """The samples this participant computes Jacobians of (all of them; CP-NTK-FL subsamples)."""
        return data.x, data.y

    def factored(self, model: nn.Module) -> bool:
        """Whether this run's Jacobians travel as Linear-layer factors (``params.upload``)."""
        if self.params.upload == "auto":
            return self.params.jacobian_method is not JacobianMethod.VMAP and fusable(model)
        return self.params.upload == "factored"

    def jacobian(self, model: nn.Module, x: Tensor) -> Any:
        """This participant's Jacobian as uploaded: factored or dense (CP-NTK-FL may sparsify)."""
        if self.factored(model):
            return factored_jacobian(model, x)
        return per_sample_jacobian(model, x, method=self.params.jacobian_method)  # (n, C, P)

    def client_update(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, ClientState]:
        trainer = ctx.trainer
        assert trainer is not None, "NTK-FL's clients need the trainer's model"
        trainer.flat.load(server.x)
        model = trainer.flat.model
        x, y = self.local_rows(data, ctx)
        t0 = time.perf_counter()
        J = self.jacobian(model, x)
        seconds = time.perf_counter() - t0
        with torch.no_grad(), eval_mode(model):
            f0 = model(x)  # (n, C)
        Y = F.one_hot(y, f0.shape[1]).to(f0.dtype)
        gathered: dict[str, Any] = {"jacobian": J, "output": f0, "label": y}
        if self.params.select == "train":
            gathered["input"] = x
        loss = float(_loss(f0.unsqueeze(0), Y, self.params.loss)[0])
        return Upload(
            sums={},
            weight=float(x.shape[0]),
            gathered=gathered,
            metrics={"loss": loss, "jacobian_s": seconds},
        ), client

    # -- server ------------------------------------------------------------------------------
    def decode(self, uploaded: Any) -> Jacobian:
        """An uploaded Jacobian as the server computes with it (CP-NTK-FL densifies top-k uploads)."""
        return uploaded

    def rows(self, aggregate: Aggregate, ctx: ServerContext) -> Rows:
        """The round's rows in participant order (CP-NTK-FL shuffles them)."""
        g = aggregate.gathered
        jac = [self.decode(j) for j in g["jacobian"]]
        C = int(jac[0].shape[1])
        labels = [F.one_hot(y, C).to(f.dtype) for y, f in zip(g["label"], g["output"], strict=True)]
        return Rows(jac, list(g["output"]), labels, list(g["input"]) if "input" in g else None)

    def server_update(
        self, server: ServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ServerState, dict[str, float | str]]:
        p, timer = self.params, _Timer()

        def reduce(t: Tensor) -> Tensor:
            start = time.perf_counter()
            out = ctx.reduce(t)
            timer.add("reduce_s", time.perf_counter() - start)
            return out

        rows = self.rows(aggregate, ctx)
        P = self.num_params
        t0 = time.perf_counter()
        H = kernel(rows.jacobians, ctx.rank, ctx.world, reduce)  # (N, N) float64
        rnd = ctx.round + 1  # NTK-FL is one stage: the run's round number
        # host syncs once a round, the same on every rank (H and the step are shared bit for bit)
        if not bool(torch.isfinite(H).all()):
            raise DivergenceError(
                f"NTK-FL: the kernel H of round {rnd} holds NaN/inf: the clients' Jacobians at the round's "
                "model are not finite (its outputs overflow); start over with a lower params.eta"
            )
        t1 = time.perf_counter()
        step = self.shared_step(H, rows, server.x.dtype, ctx.rank, reduce)
        diverged = f"lower params.eta (now {p.eta:g}; the grid reaches t={max(p.grid)})"
        if not bool(torch.isfinite(step.updates).all() and torch.isfinite(step.outputs).all()):
            raise DivergenceError(f"NTK-FL: the evolution of round {rnd} became NaN/inf; {diverged}")
        t3 = time.perf_counter()
        candidates = server.x[:P].to(torch.float64) + step.updates  # (Ψ, P)
        losses = self.selection_losses(candidates.to(server.x.dtype), rows, step.outputs)
        best = int(torch.argmin(losses))
        t4 = time.perf_counter()
        x = server.x.clone()
        x[:P] = candidates[best].to(x.dtype)
        if not bool(torch.isfinite(x[:P]).all() and torch.isfinite(losses[best])):  # float64 → model dtype
            raise DivergenceError(
                f"NTK-FL: the weight update of round {rnd} made the model or its loss NaN/inf; {diverged}"
            )
        product = resolve_precision(p.kernel_product, H, server.x.dtype) if p.loss == "ce" else "eigh"
        metrics: dict[str, float | str] = {
            "evolve_product": product,
            "t_star": float(p.grid[best]),
            "select_loss": float(losses[best]),
            **step.spectrum,
            "evolve_steps": float(step.steps),
            "evolve_dt": step.dt,
            "kernel_s": t1 - t0,
            "eigh_s": step.eigh_s,
            "evolve_s": step.evolve_s,
            "update_s": step.update_s,
            "share_s": t3 - t1 - step.evolve_s - step.eigh_s - step.update_s,  # incl. the reduce
            "select_s": t4 - t3,
            "reduce_s": timer.parts.get("reduce_s", 0.0),
        }
        return ServerState(x=x), metrics

    def shared_step(
        self, H: Tensor, rows: Rows, dtype: torch.dtype, rank: int, reduce: Callable[[Tensor], Tensor]
    ) -> SharedStep:
        """The evolution and the weight update of every grid point (and, with ``kernel_cond``, H's
        spectrum), computed once, on rank 0, and shared by ONE reduce to which the other ranks add
        zeros (exact): every rank holds rank 0's numbers bit for bit, so a run ends with the same
        bits on any number of ranks, and no rank repeats rank 0's work. The kernel's blocks stay
        shared among ranks; the evolution's products of H are sequential in t. ``dtype``: the
        model's, that of the cross-entropy evolution's products of H."""
        p = self.params
        Psi, N, C, P = len(p.grid), rows.total, int(rows.jacobians[0].shape[1]), self.num_params
        tail = 7  # steps, dt, eigh, evolve and update seconds, λ_max, condition number
        packed = torch.zeros(Psi * (N * C + P) + tail, dtype=torch.float64, device=H.device)
        if rank == 0:
            start = time.perf_counter()
            f0, Y = torch.cat(rows.outputs), torch.cat(rows.labels)  # (N, C)
            evo = evolve(
                H,
                f0,
                Y,
                lr=p.eta,
                grid=p.grid,
                mode=p.evolution,
                loss=p.loss,
                dt=p.ce_dt,
                dtype=dtype,
                precision=p.kernel_product,
            )
            evolved = time.perf_counter()
            clients = range(len(rows.jacobians))
            dw = weight_updates(rows.jacobians, evo.sums, clients, lr=p.eta, per_output=p.loss == "mse")
            updated = time.perf_counter()
            lam_max, cond = condition(H, evo.eigenvalues) if p.kernel_cond else (0.0, 0.0)
            seconds = [evolved - start - evo.eigh_seconds, updated - evolved]
            numbers = [float(evo.steps), evo.dt, evo.eigh_seconds, *seconds, lam_max, cond]
            packed = torch.cat(
                [
                    evo.outputs.flatten(),
                    dw.flatten(),
                    torch.tensor(numbers, dtype=torch.float64, device=H.device),
                ]
            )
        packed = reduce(packed)
        outputs = packed[: Psi * N * C].view(Psi, N, C)
        updates = packed[Psi * N * C : Psi * (N * C + P)].view(Psi, P)
        steps, dt, eigh_s, evolve_s, update_s, lam_max, cond = (float(v) for v in packed[-tail:])
        spectrum = {"kernel_cond": cond, "kernel_lambda_max": lam_max} if p.kernel_cond else {}
        return SharedStep(updates, outputs, int(steps), dt, spectrum, eigh_s, evolve_s, update_s)

    def selection_losses(self, candidates: Tensor, rows: Rows, outputs: Tensor) -> Tensor:
        """The loss of each candidate (Ψ,): the real network on the round's inputs (``select:
        train``) or on the held-out clients (``select: validation``), or the closed-form outputs
        f⁽ᵗ⁾ (``select: kernel``)."""
        Y = torch.cat(rows.labels)
        if self.params.select == "kernel":
            return _loss(outputs, Y.to(outputs.dtype), self.params.loss)
        if self.params.select == "validation":
            if self.network is None or self.validation is None:
                raise RuntimeError("NTK-FL's server needs attach(model, validation) for select: validation")
            vx, vy = self.validation
            vY = F.one_hot(vy, Y.shape[1]).to(Y.dtype)
            return batched_losses(self.network, candidates, vx, vY, self.params.loss)
        if self.network is None or rows.inputs is None:
            raise RuntimeError("NTK-FL's server needs attach(model) and the round's inputs for select: train")
        return batched_losses(self.network, candidates, torch.cat(rows.inputs), Y, self.params.loss)


def _loss(f: Tensor, Y: Tensor, kind: str) -> Tensor:
    """Per-candidate loss of outputs ``f`` (Ψ, N, C) against one-hot Y (N, C) → (Ψ,): the halved
    MSE averaged over samples and outputs (the paper's ℓ), or the mean cross entropy."""
    if kind == "mse":
        return 0.5 * ((f - Y) ** 2).mean(dim=(1, 2))
    return -(torch.log_softmax(f, dim=2) * Y).sum(dim=2).mean(dim=1)


@torch.no_grad()
def batched_losses(
    model: nn.Module, candidates: Tensor, x: Tensor, Y: Tensor, kind: str, *, chunk: int = 8
) -> Tensor:
    """The real network's loss at every candidate parameter vector (Ψ, P) on (x, Y) → (Ψ,) float64,
    candidates vmapped over ``functional_call`` ``chunk`` at a time (buffers as the model has them)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for _, p in named]

    def forward(theta: Tensor) -> Tensor:
        params = {n: t.view_as(p) for (n, p), t in zip(named, theta.split(sizes), strict=True)}
        return functional_call(model, params, (x,))  # (N, C)

    out = []
    with eval_mode(model):
        for s in range(0, candidates.shape[0], chunk):
            f = vmap(forward)(candidates[s : s + chunk])  # (chunk, N, C)
            out.append(_loss(f.to(torch.float64), Y.to(torch.float64), kind))
    return torch.cat(out)
