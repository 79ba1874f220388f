"""A private version of a model-averaging algorithm: clipping, noise and accounting around its steps.

:class:`Private` wraps an algorithm that declares the level (``Algorithm.dp_levels``: FedAvg, FedProx,
FedAdam, FedAvgM, or a plugin; its local work, however it trains, and its server step are kept) and
adds, at the level the config names:

- ``client`` (DP-FedAvg, McMahan et al. 2018, Algorithm 1 with the fixed denominator qK): every
  participant's update Δ_k = y_k − x is clipped to norm S BEFORE it enters the round buffer, and
  uploaded unweighted (weight 1: a weight n_k would let one client's size scale its influence). After
  the allreduce every rank adds the SAME noise N(0, (z_Δ·S)²·I), drawn from a generator that depends
  only on (seed, round), and divides by the expected participant count qK, so the run stays
  bit-identical on any number of ranks and after a resume. The wrapped server step then sees
  x + that mean as the round's averaged model. Participants are POISSON-sampled (each client
  independently with q = M/K), the sampling Opacus's accountant assumes; the count of a round
  therefore varies around M.
  With adaptive clipping (Andrew et al. 2021, Algorithm 1), each participant also adds
  b_k = 1[‖Δ_k‖ ≤ S]; the server noises the count with σ_b, b̄ = (Σb_k + N(0, σ_b²))/qK, and
  S ← S·exp(−η_C(b̄ − γ)). The two releases share the budget: the update's noise multiplier is
  z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (the paper's Theorem 1), so the accountant sees z for the pair.
- ``sample`` (DP-SGD, Abadi et al. 2016): the runner's trainer is a :class:`hpcfl.privacy.sgd.DPTrainer`,
  whose one primitive (``Trainer.steps``) every way of training goes through, so a declared task, a
  trainer call inside ``local_task`` and an algorithm's own ``client_update`` are all DP-SGD. This
  wrapper accounts: each participant trains through a recording copy of the trainer and uploads the
  DP-SGD steps it actually took (one unweighted count per client, in the round's sum), so client
  k's records are accounted for every step of every phase, with q_k = B/n_k; ε is the worst over
  clients. The participants train one by one (through ``client_update``, which records).

Every way an algorithm can train is forwarded (``local_task``, ``client_update``, and the personal
models of a personalised one); what the wrapper cannot make private is refused in one line when it
is built, before the first round (:func:`refusal`): at client level an upload with anything beside
the model x (the clip bounds x alone), at either level a stage whose algorithm a stage hook builds.

The accountant's state (steps per privacy unit, and the same split by the noise multiplier they were
taken at), the current clip and the budget flag are fields of the server state, so they are
checkpointed with it. A resume with more ``rounds`` recalibrates σ for a target ε; the rounds already
taken stay accounted at their own σ (a composition over the actual history), and the target then
stops the run like ``epsilon_budget`` does, so the reported ε is never less than what was spent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    Exchange,
    LocalTask,
    ServerContext,
    ServerState,
    Stage,
    SumSpec,
    Upload,
)
from hpcfl.algorithms.participation import Population
from hpcfl.errors import ConfigError
from hpcfl.privacy import accountant
from hpcfl.privacy.section import AdaptiveClipSection
from hpcfl.privacy.sgd import DPTrainer
from hpcfl.training.seeds import seeded_generator
from hpcfl.training.sgd import LocalSchedule

DP_FIELDS = ("dp_clip", "dp_steps", "dp_exhausted", "dp_history", "dp_peak")
#: the sum each participant adds its DP-SGD steps to, at its client's index (sample level)
STEPS_TAKEN = "dp_steps_taken"
EXHAUSTED_BUDGET, EXHAUSTED_TARGET = 1.0, 2.0  # dp_exhausted: which limit the next round would cross


@dataclass(frozen=True)
class Mechanism:
    """The resolved mechanism of a run: level, noise multiplier z (given or calibrated), clip, and
    what is accounted. ``rate``: client level, q = M/K."""

    level: str  # client | sample
    sigma: float
    clip: float
    delta: float
    kind: str  # rdp | prv
    seed: int
    rate: float = 1.0
    budget: float | None = None
    target: float | None = None  # privacy.epsilon σ was calibrated for (a limit too: see module docstring)
    adaptive: AdaptiveClipSection | None = None
    count_stddev: float = 0.0  # σ_b (adaptive clipping)

    @property
    def update_sigma(self) -> float:
        """z_Δ: the update's noise multiplier once the count's release takes its share (Andrew et
        al. 2021, Theorem 1); z itself without adaptive clipping."""
        if self.adaptive is None:
            return self.sigma
        return (self.sigma**-2 - (2.0 * self.count_stddev) ** -2) ** -0.5


@functools.cache
def private_state(cls: type[ServerState]) -> type[ServerState]:
    """``cls`` with the privacy fields: the clip S (float64, (1,)), the accounted steps per privacy
    unit (float64; (1,) at client level, (K,) at sample level), the budget flag (1.0 when the next
    round would exceed ``epsilon_budget``, 2.0 the calibrated target ε), the history (float64,
    (segments, 1 + units): σ, then the steps each unit took at that σ) and the most steps each unit
    took in one round (float64, (units,): what the budget check expects of the next round)."""
    return dataclasses.make_dataclass(
        f"Private{cls.__name__}",
        [(name, "torch.Tensor | None", dataclasses.field(default=None)) for name in DP_FIELDS],
        bases=(cls,),
        namespace={"server_only": (*cls.server_only, "dp_steps", "dp_exhausted", "dp_history", "dp_peak")},
    )


def noise_generator(seed: int, rnd: int) -> torch.Generator:
    """The round's noise generator: a pure function of (seed, round), the same on every rank."""
    return seeded_generator(seed, 0xD1FF, rnd)


def clip_update(delta: torch.Tensor, clip: float) -> tuple[torch.Tensor, bool]:
    """Δ·min(1, S/‖Δ‖) and whether ‖Δ‖ ≤ S (the adaptive-clipping bit)."""
    norm = float(delta.double().norm())
    below = norm <= clip
    return (delta if below else delta * (clip / norm)), below


def adaptive_clip_step(clip: float, below_fraction: float, p: AdaptiveClipSection) -> float:
    """Andrew et al. (2021), Algorithm 1: the geometric update S ← S·exp(−η_C(b̄ − γ))."""
    assert p.target_quantile is not None
    return clip * math.exp(-p.lr * (below_fraction - p.target_quantile))


def check_privatisable(inner: Algorithm, level: str) -> None:
    """Refuse, in one line naming the algorithm and the reason, what the wrapper cannot make private
    (:func:`refusal`)."""
    why = refusal(inner, level)
    if why is not None:
        raise ConfigError(f"privacy.level={level} cannot make algorithm {inner.name!r} private: {why}")


def refusal(inner: Algorithm, level: str) -> str | None:
    """Why the privacy wrapper cannot make ``inner`` private at ``level`` (one clause), or None.

    At either level a stage whose algorithm a stage hook builds (``Stage.enter``) would run outside
    the wrapper. At client level the clip bounds the model x alone, so the upload must be exactly the
    whole model: no other sum, nothing gathered. (At sample level the upload is computed from
    DP-SGD models and needs no bound.)"""
    for stage in inner.stages():
        if stage.enter is not None:
            return f"its stage {stage.name!r} runs an algorithm of its own (Stage.enter), outside the privacy wrapper"
    if level != "client":
        return None
    ex = inner.exchange(torch.float32)
    others = [spec.name for spec in ex.sums if spec.name != "x"]
    if others:
        names = ", ".join(repr(n) for n in others)
        return f"its upload holds {names} beside the model x, which the client-level clip does not bound"
    if ex.gathers:
        names = ", ".join(repr(n) for n in ex.gathers)
        return f"it gathers {names} beside the model x, which the client-level clip does not bound"
    length = next((spec.length for spec in ex.sums if spec.name == "x"), 0)
    if length != inner.state_size:
        return (
            f"its upload is {length} of the model's {inner.state_size} entries, not the whole model x "
            "the client-level clip bounds"
        )
    return None


class Private(Algorithm[Any, ServerState, ClientState]):
    """``inner`` made differentially private at ``mechanism.level`` (module docstring)."""

    def __init__(
        self, inner: Algorithm, mechanism: Mechanism, population: Population, schedule: LocalSchedule
    ) -> None:
        check_privatisable(inner, mechanism.level)
        super().__init__(inner.params, layout=inner.layout, participation=inner.participation)
        self.name = inner.name  # type: ignore[misc]
        self.unbatched_reason = inner.unbatched_reason  # type: ignore[misc]
        if mechanism.level == "sample":
            self.unbatched_reason = "DP-SGD trains each participant alone, recording its steps"  # type: ignore[misc]
        self.divergence_params = inner.divergence_params  # type: ignore[misc]
        self.personalised = inner.personalised  # type: ignore[misc]
        self.inner = inner
        self.mech = mechanism
        self.population = population
        self.schedule = schedule
        self.units = 1 if mechanism.level == "client" else population.size

    # -- declaration ---------------------------------------------------------------------------
    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        """Sample level: the inner exchange and each participant's DP-SGD steps (float32: small
        integers are exact in it, and it never takes per-participant slots, :func:`ordered_sums`).
        Client level: the clipped update and the clipped-below bit, unweighted."""
        if self.mech.level == "sample":
            ex = self.inner.exchange(dtype)
            taken = SumSpec(STEPS_TAKEN, self.units, torch.float32, weighted=False)
            return dataclasses.replace(ex, sums=(*ex.sums, taken))
        return Exchange(
            sums=(
                SumSpec("x", self.state_size, dtype, weighted=False),
                SumSpec("dp_below", 1, dtype, weighted=False),
            )
        )

    def participants(self, rnd: int, population: Population, generator: torch.Generator) -> list[int]:
        """Client level: Poisson sampling, each client with q = M/K (what the accountant assumes)."""
        if self.mech.level == "sample":
            return self.inner.participants(rnd, population, generator)
        # host: seeded client sampling
        take = torch.rand(population.size, generator=generator, dtype=torch.float64) < self.mech.rate
        return [int(k) for k in torch.nonzero(take).flatten()]

    def stages(self) -> Sequence[Stage]:
        return self.inner.stages()

    # -- accounting ----------------------------------------------------------------------------
    def rates(self) -> list[float]:
        """q of every privacy unit: M/K at client level, B/n_k per client at sample level."""
        if self.mech.level == "client":
            return [self.mech.rate]
        B = self.schedule.batch_size
        return [min(1.0, B / n) for n in self.population.sizes]

    def extend(self, history: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """``history`` with ``add`` steps per unit taken at this run's σ (a new segment when σ changed)."""
        sigma = self.mech.sigma
        if len(history) and float(history[-1, 0]) == sigma:
            out = history.clone()
            out[-1, 1:] += add
            return out
        # host: accountant bookkeeping
        row = torch.cat([torch.tensor([sigma], dtype=torch.float64), add.to(torch.float64)])
        return torch.cat([history, row[None]])

    def history_of(self, server: ServerState) -> torch.Tensor:
        """The server's history; a checkpoint written before it was kept has only the step counts,
        which were all taken at one σ: this run's (what that version assumed)."""
        history = getattr(server, "dp_history", None)
        if history is not None:
            return history
        empty = torch.zeros(0, 1 + self.units, dtype=torch.float64)  # host: accountant bookkeeping
        steps = getattr(server, "dp_steps", None)
        return empty if steps is None or not float(steps.sum()) > 0 else self.extend(empty, steps)

    def round_steps(self, who: Sequence[int]) -> torch.Tensor:
        """Steps one round is expected to add to each unit: 1 (client level), or each participant's
        local steps under the run's schedule (sample level; what the participants actually took is
        what is accounted: :meth:`server_update`)."""
        add = torch.zeros(self.units, dtype=torch.float64)  # host: accountant bookkeeping
        if self.mech.level == "client":
            add[0] = 1.0
        else:
            for k in who:
                add[k] = float(self.schedule.num_steps(self.population.sizes[k]))
        return add

    def epsilon(self, history: torch.Tensor) -> float:
        """The worst unit's ε(δ) over the history, every segment at its own σ."""
        sigmas = history[:, 0].tolist()
        units = {
            tuple((s, q, int(n)) for s, n in zip(sigmas, column, strict=True) if n > 0)
            for q, column in zip(self.rates(), history[:, 1:].T.tolist(), strict=True)
        }
        return max(
            (accountant.history_epsilon(u, self.mech.delta, self.mech.kind) for u in units if u), default=0.0
        )

    def _exhausted(self, history: torch.Tensor, peak: torch.Tensor | None = None) -> torch.Tensor:
        """EXHAUSTED_BUDGET/TARGET when one more round (every client taking part, each with the most
        steps it took in one round or the run's schedule's, the worst case) would exceed
        ``epsilon_budget`` / the target ε σ was calibrated for (within the calibration's tolerance),
        else 0."""
        flag = 0.0
        limits = [(self.mech.budget, EXHAUSTED_BUDGET)]
        if self.mech.target is not None:
            limits.append((self.mech.target + accountant.CALIBRATION_TOLERANCE, EXHAUSTED_TARGET))
        limits = [(limit, code) for limit, code in limits if limit is not None]
        if limits:
            expected = self.round_steps(range(self.population.size))
            if peak is not None:  # a unit that took more in one round (a second local phase)
                expected = torch.maximum(expected, peak)
            eps = self.epsilon(self.extend(history, expected))
            flag = next((code for limit, code in sorted(limits) if eps > limit), 0.0)
        return torch.tensor([flag], dtype=torch.float64)  # host: accountant bookkeeping

    # -- states --------------------------------------------------------------------------------
    def _wrap(self, inner_state: ServerState, **dp: torch.Tensor) -> ServerState:
        cls = private_state(_inner_class(type(inner_state)))
        values = {f.name: getattr(inner_state, f.name) for f in dataclasses.fields(inner_state)}
        values.update(dp)
        return cls(**values)

    def init_server(self, x0: torch.Tensor) -> ServerState:
        steps = torch.zeros(self.units, dtype=torch.float64)  # host: accountant bookkeeping
        history = torch.zeros(0, 1 + self.units, dtype=torch.float64)  # host: accountant bookkeeping
        clip = torch.tensor([self.mech.clip], dtype=torch.float64)  # host: the clip, read as a float
        return self._wrap(
            self.inner.init_server(x0),
            dp_clip=clip,
            dp_steps=steps,
            dp_exhausted=self._exhausted(history),
            dp_history=history,
            dp_peak=steps.clone(),
        )

    def init_client(self, k: int, server: ServerState) -> ClientState:
        return self.inner.init_client(k, server)

    # -- steps ---------------------------------------------------------------------------------
    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState] | None:
        """Client level: the inner task, its upload clipped (:meth:`clipped`). Sample level: none,
        every participant trains through :meth:`client_update`, which records its steps."""
        if self.mech.level == "sample":
            return None
        task = self.inner.local_task(server, client, data, ctx)
        if task is None:
            return None
        inner_finish = task.finish

        def finish(y: torch.Tensor, result: Any) -> tuple[Upload, ClientState]:
            upload, state = inner_finish(y, result)
            return self.clipped(server, upload), state

        return dataclasses.replace(task, finish=finish)

    def client_update(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, ClientState]:
        """The inner ``client_update`` (its declared task or its own), private at the run's level:
        client level, the upload clipped; sample level, through a recording copy of the DP trainer,
        the steps it took added to the upload at the client's index (accounted by the server step)."""
        if self.mech.level == "client":
            upload, state = self.inner.client_update(server, client, data, ctx)
            return self.clipped(server, upload), state
        assert isinstance(ctx.trainer, DPTrainer), "sample-level DP trains through a DPTrainer"
        recording = ctx.trainer.recording()
        upload, state = self.inner.client_update(
            server, client, data, dataclasses.replace(ctx, trainer=recording)
        )
        assert recording.ledger is not None
        self.seal(server, upload, data, ctx, recording.ledger.steps)
        taken = torch.zeros(self.units, dtype=torch.float32, device=server.x.device)
        taken[data.k] = float(recording.ledger.steps)
        return dataclasses.replace(upload, sums={**upload.sums, STEPS_TAKEN: taken}), state

    def seal(
        self, server: ServerState, upload: Upload, data: ClientData, ctx: ClientContext, taken: int
    ) -> None:
        """Sample level: refuse, in one line naming the client and the rule, a participant that
        uploads a model other than the one it received while it took fewer DP-SGD steps than its
        schedule (none at all, or some): it trained some other way (``torch.optim`` on the
        trainer's model, a fresh :class:`Trainer`, ``Trainer.steps`` called past the DP trainer's
        own, ``descend``, :class:`LocalSteps`), and its upload is not private. What this cannot
        see: non-private training beside a full schedule of DP-SGD steps."""
        assert ctx.trainer is not None
        due = ctx.trainer.schedule.num_steps(data.n)  # the participant's own (system.work) schedule
        y = upload.sums.get("x")
        if taken >= due or y is None or torch.equal(y, server.x):
            return
        raise ConfigError(
            f"privacy.level=sample: algorithm {self.name!r}, client {data.k}, round {ctx.round + 1}: its upload "
            f"differs from the model it received, but it took {taken} of its {due} DP-SGD steps; under "
            "sample-level DP a participant trains only through ctx.trainer (its train/run/steps), every step "
            "of its schedule (docs/privacy.md: what sample-level DP checks)"
        )

    def clipped(self, server: ServerState, upload: Upload) -> Upload:
        """Client level: the update Δ = x_k − x clipped to S, unweighted, with the bit ‖Δ‖ ≤ S."""
        clip = float(server.dp_clip[0])  # type: ignore[attr-defined]
        x = server.x
        delta, below = clip_update(upload.sums["x"] - x, clip)
        b = torch.tensor([float(below)], dtype=x.dtype, device=x.device)
        return Upload(sums={"x": delta, "dp_below": b}, weight=1.0, metrics=upload.metrics)

    def personal_model(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> torch.Tensor:
        """The inner personal model, built at evaluation time outside the accountant: its figures
        are labelled non-private (``personal_private: false``, :mod:`hpcfl.runner.client_eval`)."""
        return self.inner.personal_model(server, client, data, ctx)

    def seal_server(self, before: torch.Tensor, after: torch.Tensor, rnd: int) -> None:
        """Sample level: refuse a server step that moves the model (beyond float rounding of a mean
        of unchanged models) while no participant has taken a DP-SGD step yet: it trained on data
        some other way (data kept from ``client_update``), outside the private path, and the run
        would be reported with ε = 0."""
        if torch.allclose(after, before, rtol=1e-5, atol=1e-6):
            return
        raise ConfigError(
            f"privacy.level=sample: algorithm {self.name!r}, round {rnd + 1}: the server step changed the model "
            "although no participant has taken a DP-SGD step yet; under sample-level DP only the participants' "
            "DP-SGD steps may train (docs/privacy.md: what sample-level DP checks)"
        )

    def server_update(
        self, server: ServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ServerState, dict[str, float]]:
        mech = self.mech
        clip = server.dp_clip  # type: ignore[attr-defined]
        S = float(clip[0])
        if mech.level == "client":
            expected = mech.rate * self.population.size  # qK: the fixed denominator
            gen = noise_generator(mech.seed, ctx.round)
            # host: seeded, moved once a round
            noise = torch.randn(self.state_size, generator=gen, dtype=torch.float64) * (mech.update_sigma * S)
            summed = aggregate.sums["x"]
            total = summed + noise.to(device=summed.device, dtype=summed.dtype)
            if mech.adaptive is not None:
                # host: read as a float
                count_noise = float(torch.randn(1, generator=gen, dtype=torch.float64)) * mech.count_stddev
                below = (float(aggregate.sums["dp_below"][0]) + count_noise) / expected
                # host: the clip, read as a float
                clip = torch.tensor([adaptive_clip_step(S, below, mech.adaptive)], dtype=torch.float64)
            aggregate = Aggregate(sums={"x": server.x + total / expected}, weight=1.0, count=aggregate.count)
            add = self.round_steps(ctx.participants)
        else:  # the steps each participant took, every phase (host: accountant bookkeeping)
            add = aggregate.sums[STEPS_TAKEN].to(device="cpu", dtype=torch.float64)
            inner_sums = {name: v for name, v in aggregate.sums.items() if name != STEPS_TAKEN}
            aggregate = dataclasses.replace(aggregate, sums=inner_sums)
        inner_state, metrics = self.inner.server_update(server, aggregate, ctx)
        steps = server.dp_steps + add  # type: ignore[attr-defined]
        history = self.extend(self.history_of(server), add)
        if mech.level == "sample" and not float(history[:, 1:].sum()) > 0:
            self.seal_server(server.x, inner_state.x, ctx.round)
        peak = getattr(server, "dp_peak", None)  # None: a checkpoint written before it was kept
        peak = add if peak is None else torch.maximum(peak, add)
        new = self._wrap(
            inner_state,
            dp_clip=clip,
            dp_steps=steps,
            dp_exhausted=self._exhausted(history, peak),
            dp_history=history,
            dp_peak=peak,
        )
        row = dict(metrics)
        row.update(epsilon=self.epsilon(history), dp_noise_multiplier=mech.sigma, dp_clip=S)
        return new, row


def _inner_class(cls: type) -> type:
    """The wrapped algorithm's own server-state class (strip a Private* layer)."""
    while cls.__name__.startswith("Private") and DP_FIELDS[0] in {f.name for f in dataclasses.fields(cls)}:
        cls = cls.__bases__[0]
    return cls
