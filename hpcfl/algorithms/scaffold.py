"""SCAFFOLD (Karimireddy et al., 2020), in two forms.

``control_variates`` (Karimireddy et al., Algorithm 1, Option II): the server holds c, client k
holds c_k; local steps follow ∇L_k − c_k + c; c_k⁺ = c_k − c + (x − y_k)/(η‖a_k‖₁); the
participants upload y_k and Δc_k = c_k⁺ − c_k (summed, unweighted); the server sets x to the
mean of the y_k (``weighting``) and c ← c + (|S|/N)·mean_S Δc_k = c + Σ_S Δc_k / N. Twice
FedAvg's upload.

``one_model`` (TCT, Appendix A.1): each client keeps a correction h_k and its last local model
θ̂_k. At round t it sets h_k ← h_k + (θ^t − θ̂_k)/(η‖a_k‖₁), runs its local steps on ∇L_k − h_k
from θ^t and uploads only its model: FedAvg's traffic. It is Option II exactly (in exact
arithmetic) when every client takes part in every round, the server mean is uniform and every
client takes the same number of local steps K. Derivation: under full participation c is the
uniform mean of the c_k, so the shift s_k = c_k − c evolves as
s_k⁺ = s_k + (x − y_k)/(η‖a_k‖₁) − (1/N)Σ_j (x − y_j)/(η‖a_j‖₁); with equal ‖a‖₁ and the uniform
mean θ⁺ = (1/N)Σ_j y_j the last two terms are (θ⁺ − y_k)/(η‖a‖₁), the one-model step. With
n_k-weighted means or unequal step counts (``local_epochs`` on clients of unequal sizes) θ⁺ is not
that mean and the one-model form is another algorithm (issue 33: +8.8 points over NIID-Bench's
SCAFFOLD on ``classes:2``). ``auto`` (the default) therefore picks ``one_model`` only where it is
provably Option II — full participation, ``weighting: uniform`` and equal step counts for every
client — and ``control_variates`` otherwise; the form used is the ``scaffold_form`` column of
every metrics row.

‖a_k‖₁ (:func:`hpcfl.training.sgd.local_norm`) is the local momentum's effective step count,
(K − β(1 − β^K)/(1 − β))/(1 − β), K at β = 0 (the same floating-point ops as the K·η of the papers,
so β = 0 results are unchanged). The correction −c_k + c enters the momentum buffer like the
gradient, so K steps move the model by η‖a_k‖₁ per unit of the mean corrected direction; dividing by
Kη instead (what Algorithm 1 says for plain SGD) makes the variates ‖a‖₁/K too large and the shift
is multiplied by (1 − ‖a‖₁/K) every round (−3.1 at K = 10, β = 0.9): SCAFFOLD then diverges
(issue 25). None of the reference codes combines an in-buffer correction, momentum and Kη.

``correction`` (default ``buffer``): where the shift −c_k + c enters. ``buffer`` adds it to the
gradient before the momentum buffer (the FedPVR authors' ``p.grad += c − c_k`` before
``optimizer.step()``) and divides the variates by η‖a_k‖₁ as above; its fixed point is exactly the
optimum of (1/N)Σ f_k for any η (with s_k = ∇f_k(x*) every local step is zero). ``after_step`` is
NIID-Bench's placement (``experiments.py``: ``optimizer.step()``, then ``w ← w − η(c − c_k)``,
variates divided by Kη, which is what the shift itself moves): at momentum 0 it is the same
algorithm bit for bit; under momentum the momentum-shaped gradient path and the constant
after-step shift cannot cancel step by step, so its fixed point is off the optimum by O(η)
(measured on the tests' least-squares problem at β = 0.9: stalls at 3.4 % relative error for
η = 0.05/L, 2.9× the optimum's norm for η = 0.3/L, where ``buffer`` reaches 1e-7). It is offered
to reproduce NIID-Bench, not as a fix. It is computed in the buffer, the same in exact arithmetic:
adding s at the first step and (1 − β)s at every later one keeps the buffer equal to the
gradients' buffer plus s (m'_t = β m'_{t−1} + g_t + (1 − β)s = m_t + s).

``weighting`` (default ``uniform``): SCAFFOLD's Algorithm 1 (x ← x + (η_g/|S|)Σ_S Δy_k) and the
FedPVR authors' ``aggregate/scaffold.py`` take the uniform mean of the client models (buffers
included); ``samples`` gives NIID-Bench's n_k-weighted mean (TCT's footnote 5).

Weight decay: the FedPVR authors' ``opt/opt.py`` trains SCAFFOLD (and FedPVR) with weight decay 0;
hpcfl's run-wide ``weight_decay`` (default 1e-5) applies to every algorithm alike, so a "paper code"
run of SCAFFOLD sets ``weight_decay: 0`` (``benchmarks/README.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    Exchange,
    HyperParams,
    LocalTask,
    ServerContext,
    ServerState,
    SumSpec,
    Upload,
    check_weighting,
    model_upload,
)
from hpcfl.algorithms.participation import Participation, Population
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection
from hpcfl.training.sgd import LocalResult, LocalSchedule, local_norm


@dataclass(frozen=True)
class ScaffoldParams(HyperParams):
    """SCAFFOLD's hyper-parameters (Karimireddy et al., ICML 2020, Algorithm 1, Option II).

    - ``form``: ``auto`` (``one_model`` where it is provably Option II: full participation, uniform
      weighting, equal step counts; ``control_variates`` otherwise), ``one_model`` (TCT Appendix A.1)
      or ``control_variates`` (Algorithm 1); see the module docstring;
    - ``weighting``: ``uniform`` (default; Algorithm 1 and the FedPVR authors' code) or ``samples``
      (n_k-weighted, NIID-Bench);
    - ``correction``: ``buffer`` (default; the FedPVR authors' placement, exact under momentum) or
      ``after_step`` (NIID-Bench's; biased under momentum, see the module docstring).
    """

    form: str = "auto"
    weighting: str = "uniform"
    correction: str = "buffer"

    def __post_init__(self) -> None:
        if self.form not in ("auto", "one_model", "control_variates"):
            raise ConfigError(
                f"config key 'params.form' must be auto, one_model or control_variates, got {self.form!r}"
            )
        check_weighting(self.weighting)
        if self.correction not in ("buffer", "after_step"):
            raise ConfigError(
                f"config key 'params.correction' must be buffer or after_step, got {self.correction!r}"
            )


@dataclass
class ScaffoldServerState(ServerState):
    """x and, in the control-variate form, the server control variate c (None otherwise)."""

    c: torch.Tensor | None = None


@dataclass
class ScaffoldClientState(ClientState):
    """h: the client's correction (one_model) or control variate c_k; last_local: θ̂_k (one_model)."""

    h: torch.Tensor | None = None
    last_local: torch.Tensor | None = None


def correction_update(
    h: torch.Tensor | None,
    x: torch.Tensor,
    y: torch.Tensor | None,
    steps: int,
    lr: float,
    momentum: float = 0.0,
) -> torch.Tensor:
    """h + (x − y)/(η‖a‖₁): SCAFFOLD's control-variate step (shared with FedPVR and TCT's stage 2),
    ‖a‖₁ = :func:`~hpcfl.training.sgd.local_norm` (``steps``, ``momentum``), which is ``steps`` at
    momentum 0 (then exactly the papers' (x − y)/(Kη))."""
    h = h if h is not None else torch.zeros_like(x)
    return h if y is None else h + (x - y) / (local_norm(steps, momentum) * lr)


def choose_form(
    params: ScaffoldParams,
    participation: Participation,
    population: Population,
    schedule: LocalSchedule,
    *,
    heterogeneous: bool = False,
) -> str:
    """The form ``auto`` stands for: ``one_model`` only where it is provably Option II (every client
    in every round, uniform mean, the same number of local steps for every client). Under a
    ``system`` section (``heterogeneous``: unequal work or dropped participants) it is never that:
    ``auto`` is ``control_variates`` and an explicit ``one_model`` is refused."""
    if heterogeneous and params.form == "one_model":
        raise ConfigError(
            "params.form: one_model assumes every client does the same work in every round, which the "
            "system section changes; use form: control_variates (or auto)"
        )
    if params.form != "auto":
        return params.form
    equal_steps = len({schedule.num_steps(n) for n in population.sizes}) <= 1
    if participation.full(population) and params.weighting == "uniform" and equal_steps and not heterogeneous:
        return "one_model"
    return "control_variates"


class AfterStepShift:
    """The shift s applied after the momentum step (NIID-Bench's placement), written as an in-buffer
    correction: −s at a client's first local step, −(1 − β)s at every later one, so the momentum
    buffer is the gradients' buffer plus s. One instance per client and round (it counts steps)."""

    def __init__(self, shift: torch.Tensor, momentum: float) -> None:
        self.shift = shift
        self.later = shift * (1.0 - momentum)
        self.steps = 0

    def __call__(self, w: torch.Tensor, d: torch.Tensor) -> None:
        d.sub_(self.shift if self.steps == 0 else self.later)
        self.steps += 1


class Scaffold(Algorithm[ScaffoldParams, ScaffoldServerState, ScaffoldClientState]):
    name = "scaffold"
    dp_refusal = "its control variates are a second upload the clip does not bound"
    Params = ScaffoldParams

    @property
    def control_variates(self) -> bool:
        """Whether this run uses the control-variate form (``auto`` not yet resolved by
        :meth:`resolved`: the control-variate form, which is Option II in every case)."""
        return self.params.form != "one_model"

    def resolved(
        self, population: Population, schedule: LocalSchedule, *, heterogeneous: bool = False
    ) -> Scaffold:
        """This algorithm with ``form: auto`` replaced by :func:`choose_form`'s choice."""
        form = choose_form(self.params, self.participation, population, schedule, heterogeneous=heterogeneous)
        if form == self.params.form:
            return self
        params = dataclasses.replace(self.params, form=form)
        return type(self)(params, layout=self.layout, participation=self.participation)

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        sums = (SumSpec("x", self.state_size, dtype),)
        if self.control_variates:
            sums += (SumSpec("dc", self.num_params, dtype, weighted=False),)
        return Exchange(sums=sums)

    def init_server(self, x0: torch.Tensor) -> ScaffoldServerState:
        c = torch.zeros_like(x0[: self.num_params]) if self.control_variates else None
        return ScaffoldServerState(x=x0.clone(), c=c)

    def init_client(self, k: int, server: ScaffoldServerState) -> ScaffoldClientState:
        return ScaffoldClientState()

    def local_task(
        self, server: ScaffoldServerState, client: ScaffoldClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ScaffoldClientState]:
        trainer = ctx.trainer
        assert trainer is not None
        P = self.num_params
        steps = trainer.schedule.num_steps(data.n)
        lr, momentum = trainer.schedule.lr, trainer.schedule.momentum
        weighting = self.params.weighting
        after_step = self.params.correction == "after_step" and bool(momentum)

        beta = momentum

        def shifted(shift: torch.Tensor) -> LinearCorrection | AfterStepShift:
            return AfterStepShift(shift, beta) if after_step else LinearCorrection(shift=shift)

        if after_step:
            momentum = 0.0  # the shift moves the model by exactly ηK: the variates divide by ηK
        if self.control_variates:
            assert server.c is not None
            c = server.c
            c_k = client.h if client.h is not None else torch.zeros_like(c)

            def finish_cv(y: torch.Tensor, result: LocalResult) -> tuple[Upload, ScaffoldClientState]:
                # the steps actually taken (a participant's own work under ``system.work``)
                c_new = correction_update(c_k - c, server.x[:P], y[:P], result.steps, lr, momentum)
                upload = model_upload(y, data, result, weighting=weighting)
                upload.sums["dc"] = c_new - c_k
                return upload, ScaffoldClientState(h=c_new)

            return LocalTask(server.x, finish_cv, shifted(c_k - c))
        last = client.last_local[:P] if client.last_local is not None else None
        h = correction_update(
            client.h if client.h is not None else torch.zeros_like(server.x[:P]),
            server.x[:P],
            last,
            steps,
            lr,
            momentum,
        )

        def finish(x: torch.Tensor, result: LocalResult) -> tuple[Upload, ScaffoldClientState]:
            return model_upload(x, data, result, weighting=weighting), ScaffoldClientState(h=h, last_local=x)

        return LocalTask(server.x, finish, shifted(h))

    def server_update(
        self, server: ScaffoldServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ScaffoldServerState, dict[str, float | str]]:
        x = aggregate.sums["x"] / aggregate.weight
        metrics: dict[str, float | str] = {"scaffold_form": self.params.form}
        if not self.control_variates:
            return dataclasses.replace(server, x=x), metrics
        assert server.c is not None
        c = server.c + aggregate.sums["dc"] / ctx.population.size
        return ScaffoldServerState(x=x, c=c), metrics
