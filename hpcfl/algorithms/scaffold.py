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
      (n_k-weighted, NIID-Bench).
    """

    form: str = "auto"
    weighting: str = "uniform"

    def __post_init__(self) -> None:
        if self.form not in ("auto", "one_model", "control_variates"):
            raise ConfigError(
                f"config key 'params.form' must be auto, one_model or control_variates, got {self.form!r}"
            )
        check_weighting(self.weighting)


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
    params: ScaffoldParams, participation: Participation, population: Population, schedule: LocalSchedule
) -> str:
    """The form ``auto`` stands for: ``one_model`` only where it is provably Option II (every client
    in every round, uniform mean, the same number of local steps for every client)."""
    if params.form != "auto":
        return params.form
    equal_steps = len({schedule.num_steps(n) for n in population.sizes}) <= 1
    if participation.full(population) and params.weighting == "uniform" and equal_steps:
        return "one_model"
    return "control_variates"


class Scaffold(Algorithm[ScaffoldParams, ScaffoldServerState, ScaffoldClientState]):
    name = "scaffold"
    Params = ScaffoldParams

    @property
    def control_variates(self) -> bool:
        """Whether this run uses the control-variate form (``auto`` not yet resolved by
        :meth:`resolved`: the control-variate form, which is Option II in every case)."""
        return self.params.form != "one_model"

    def resolved(self, population: Population, schedule: LocalSchedule) -> Scaffold:
        """This algorithm with ``form: auto`` replaced by :func:`choose_form`'s choice."""
        form = choose_form(self.params, self.participation, population, schedule)
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
        if self.control_variates:
            assert server.c is not None
            c = server.c
            c_k = client.h if client.h is not None else torch.zeros_like(c)

            def finish_cv(y: torch.Tensor, result: LocalResult) -> tuple[Upload, ScaffoldClientState]:
                c_new = correction_update(c_k - c, server.x[:P], y[:P], steps, lr, momentum)
                upload = model_upload(y, data, result, weighting=weighting)
                upload.sums["dc"] = c_new - c_k
                return upload, ScaffoldClientState(h=c_new)

            return LocalTask(server.x, finish_cv, LinearCorrection(shift=c_k - c))
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

        return LocalTask(server.x, finish, LinearCorrection(shift=h))

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
