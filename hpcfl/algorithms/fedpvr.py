"""FedPVR (Li, Schmidt, Alstrøm & Stich, CVPR 2023, "On the effectiveness of partial variance
reduction in federated learning with heterogeneous data"): SCAFFOLD's control variates on a slice of
the parameters only, plain local SGD on the rest.

Algorithm 1 / Eq. 3–9 of the paper, with the mask p over the trainable parameters:

- local step (Eq. 5–6): y_svr ← y_svr − η_l(g_svr − c_i + c), y_sgd ← y_sgd − η_l·g_sgd;
- client variate (Eq. 7, SCAFFOLD option II): c_i⁺ = c_i − c + (x_svr − y_svr)/(Kη_l), where Kη_l
  is the effective step η_l·‖a‖₁ of the corrected slice (:func:`~hpcfl.training.sgd.local_norm`):
  K with the paper code's plain SGD on that slice, (K − β(1−β^K)/(1−β))/(1−β) with
  ``momentum_on_corrected`` (the consistent estimate under momentum, issue 25);
- server (Eq. 8–9): x ← (1 − η_g)x + η_g·mean_S y_i (the paper's Eq. 8 drops the η_g before the
  mean; the two agree at its η_g = 1), c ← c + Σ_S Δc_i / N, which is Eq. 9's mean of the c_i under
  full participation and SCAFFOLD's |S|/N form under partial participation. ``weighting``:
  ``uniform`` (default, Eq. 8's mean and the authors' ``aggregate/scaffold.py``) or ``samples``
  (n_k-weighted).

Weight decay: the authors' ``opt/opt.py`` trains FedPVR with weight decay 0; the run-wide
``weight_decay`` applies to every parameter here, so their setting is ``weight_decay: 0``.

The exchange carries the model and Δc_i over the masked slice only, so the counted ``bytes_up`` per participant is (state + |mask|)·4 bytes and the server
variate ``c`` (what participants download beside x) has |mask| entries.

What is bit-for-bit equal (``torch.equal``, tested in ``tests/test_new_algorithms.py``):

- the full mask and :class:`~hpcfl.algorithms.scaffold.Scaffold` with ``form: control_variates``
  (same ``weighting``), under full or partial participation, when momentum is 0 or ``momentum_on_corrected: true``
  (with momentum and the paper-code default, the full mask is SCAFFOLD at momentum 0);
- the empty mask with ``weighting: samples`` and :class:`~hpcfl.algorithms.fedavg.FedAvg`, with
  or without momentum;
- neither is equal to SCAFFOLD's ``one_model`` form bit for bit (that form accumulates
  h_k ← h_k + (θ − θ̂_k)/(Kη) instead of subtracting two separately rounded variates). In exact
  arithmetic the two agree under full participation only when the model average is the uniform
  one, i.e. when all clients hold the same number of samples: the control-variate shift moves by
  (ȳ − y_k)/(Kη) with ȳ the uniform mean of Eq. 9, the one-model correction by (θ⁺ − y_k)/(Kη)
  with θ⁺ the n_k-weighted mean.
"""

from __future__ import annotations

import dataclasses
import functools
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
    SumSpec,
    Upload,
    check_weighting,
    model_upload,
)
from hpcfl.algorithms.participation import Participation
from hpcfl.algorithms.scaffold import ScaffoldServerState, correction_update
from hpcfl.errors import ConfigError
from hpcfl.training.layout import Entry, StateLayout
from hpcfl.training.sgd import LocalResult


@dataclass(frozen=True)
class FedPVRParams(HyperParams):
    """FedPVR's hyper-parameters (Li et al., CVPR 2023, Algorithm 1).

    Which parameters are variance-reduced (the mask p of Eq. 3), at most one of:

    - ``layers``: module names, e.g. ``[fc1, fc2, classifier]`` (a name selects its sub-modules);
    - ``start_param``: an index into the model's trainable parameter tensors (in
      ``named_parameters`` order; negative counts from the end): tensors ``start_param:`` are
      variance-reduced, as ``start_layer`` in the paper's code (VGG-11: 16, ResNet-8: 27);
      0 is the full mask (SCAFFOLD), the number of tensors the empty mask (FedAvg);
    - neither (default): the trailing run of ``Linear`` modules, i.e. the paper's choice — the three
      fully-connected layers of VGG-11, the last layer of ResNet-8 (Sec. 4). A model whose last
      parameter-owning module is not a ``Linear`` must name its layers.

    ``server_lr``: η_g of Eq. 8, default 1 ("we set the server learning rate η_g = 1 for all the
    models", Sec. 4).

    ``weighting``: ``uniform`` (default: Eq. 8 and the authors' ``aggregate/scaffold.py``) or
    ``samples`` (n_k-weighted server mean).

    ``corrected_weight_decay``: the weight decay of the variance-reduced parameters (a parameter
    group of its own); None (default) keeps the run's ``weight_decay`` for every parameter. The
    authors' ``opt/opt.py`` uses 0 for every parameter of FedPVR, i.e. the run-wide
    ``weight_decay: 0``; 0 here removes the decay from the corrected direction only.

    ``momentum_on_corrected``: whether the run's local momentum also applies to the
    variance-reduced parameters. Default false, as in the paper's public code, where the
    corrected parameters take plain SGD steps (Eq. 5) and momentum acts only on the others; with
    ``momentum: 0`` both settings are the same algorithm. True gives SCAFFOLD's handling (momentum
    on the corrected gradient everywhere).
    """

    layers: tuple[str, ...] = ()
    start_param: int | None = None
    server_lr: float = 1.0
    momentum_on_corrected: bool = False
    weighting: str = "uniform"
    corrected_weight_decay: float | None = None

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        if self.corrected_weight_decay is not None and not self.corrected_weight_decay >= 0:
            raise ConfigError(
                f"config key 'params.corrected_weight_decay' must be >= 0, got {self.corrected_weight_decay}"
            )
        layers = self.layers
        if isinstance(layers, str):
            layers = (layers,)
        if not isinstance(layers, (list, tuple)) or not all(isinstance(m, str) for m in layers):
            raise ConfigError(f"config key 'params.layers' must be a list of module names, got {layers!r}")
        object.__setattr__(self, "layers", tuple(layers))
        if self.layers and self.start_param is not None:
            raise ConfigError(
                "config keys 'params.layers' and 'params.start_param' exclude each other; set one"
            )
        if not self.server_lr > 0:
            raise ConfigError(f"config key 'params.server_lr' must be > 0, got {self.server_lr}")


FedPVRServerState = ScaffoldServerState  # x and the server control variate c (over the masked slice)


@dataclass
class FedPVRClientState(ClientState):
    """c_k: the client's control variate over the masked slice (None until the client trains)."""

    c: torch.Tensor | None = None


def default_mask_modules(layout: StateLayout) -> list[str]:
    """The trailing run of ``Linear`` modules among the parameter-owning modules (in vector order):
    VGG-11's fc1, fc2, classifier; ResNet-8's classifier; an MLP of Linear layers entirely."""
    run: list[str] = []
    for module in reversed(layout.modules):
        if layout.params_of([module])[0].module_type != "Linear":
            break
        run.append(module)
    return run[::-1]


def mask_entries(params: FedPVRParams, layout: StateLayout) -> list[Entry]:
    """The trainable entries FedPVR variance-reduces, by the rule ``params`` selects."""
    tensors = [e for e in layout.entries if e.kind == "param"]
    if params.layers:
        return layout.params_of(params.layers)
    if params.start_param is not None:
        n = len(tensors)
        if not -n <= params.start_param <= n:
            raise ConfigError(
                f"config key 'params.start_param' must be in [-{n}, {n}] for this model "
                f"({n} parameter tensors), got {params.start_param}"
            )
        return tensors[params.start_param :]
    modules = default_mask_modules(layout)
    if not modules:
        last = layout.modules[-1] if layout.modules else "none"
        raise ConfigError(
            f"fedpvr: the model's last layer ({last!r}) is not a Linear layer, so there is no default "
            "mask; set params.layers (module names) or params.start_param"
        )
    return layout.params_of(modules)


def spans_of(entries: list[Entry]) -> tuple[tuple[int, int], ...]:
    """The entries' [start, stop) ranges, sorted and merged where they touch."""
    out: list[list[int]] = []
    for e in sorted(entries, key=lambda e: e.start):
        if out and e.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e.stop)
        else:
            out.append([e.start, e.stop])
    return tuple((a, b) for a, b in out)


class FedPVR(Algorithm[FedPVRParams, FedPVRServerState, FedPVRClientState]):
    name = "fedpvr"
    dp_refusal = "its control variates are a second upload the clip does not bound"
    Params = FedPVRParams

    def __init__(
        self, params: FedPVRParams, *, layout: StateLayout, participation: Participation | None = None
    ) -> None:
        super().__init__(params, layout=layout, participation=participation)
        if isinstance(layout, StateLayout):  # resolve (and validate) the mask up front
            _ = self.spans
        # else: the runner's stand-in layout, used only to read stages()

    @functools.cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The masked [start, stop) ranges of the parameter vector, merged."""
        return spans_of(mask_entries(self.params, self.layout))

    @functools.cached_property
    def mask_size(self) -> int:
        """v of Eq. 3: the number of variance-reduced entries."""
        return sum(b - a for a, b in self.spans)

    @functools.cached_property
    def _packed(self) -> tuple[tuple[int, int, int], ...]:
        """(start, stop, offset in the packed v-vector) of each span."""
        packed, off = [], 0
        for a, b in self.spans:
            packed.append((a, b, off))
            off += b - a
        return tuple(packed)

    # -- the masked slice as one packed vector ----------------------------------------------
    def gather(self, vec: torch.Tensor) -> torch.Tensor:
        """The masked entries of a parameter vector, packed in vector order (v entries)."""
        if len(self.spans) == 1:
            a, b = self.spans[0]
            return vec[a:b].clone()
        return torch.cat([vec[a:b] for a, b in self.spans])

    def mask(self, device: torch.device | str) -> torch.Tensor:
        """Boolean mask over the trainable parameters: True where variance-reduced."""
        out = torch.zeros(self.num_params, dtype=torch.bool, device=device)
        for a, b in self.spans:
            out[a:b] = True
        return out

    # -- the round's declaration -------------------------------------------------------------
    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        sums = (SumSpec("x", self.state_size, dtype),)
        if self.mask_size:
            sums += (SumSpec("dc", self.mask_size, dtype, weighted=False),)
        return Exchange(sums=sums)

    def init_server(self, x0: torch.Tensor) -> FedPVRServerState:
        return FedPVRServerState(x=x0.clone(), c=x0.new_zeros(self.mask_size))

    def init_client(self, k: int, server: FedPVRServerState) -> FedPVRClientState:
        return FedPVRClientState()

    # -- the steps ---------------------------------------------------------------------------
    def local_task(
        self, server: FedPVRServerState, client: FedPVRClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[FedPVRClientState]:
        trainer = ctx.trainer
        assert trainer is not None and server.c is not None
        weighting = self.params.weighting
        if not self.mask_size:  # p = 0: FedAvg (Sec. 3.3)
            return LocalTask(
                server.x, lambda y, result: (model_upload(y, data, result, weighting=weighting), client)
            )
        lr = trainer.schedule.lr
        momentum = trainer.schedule.momentum
        # the corrected slice's effective step: momentum acts on it only with momentum_on_corrected
        slice_momentum = momentum if self.params.momentum_on_corrected else 0.0
        c = server.c
        c_k = client.c if client.c is not None else torch.zeros_like(c)
        shift = c_k - c  # (v,)
        spans = self._packed
        wd = trainer.schedule.weight_decay
        wd_c = self.params.corrected_weight_decay
        undo = 0.0 if wd_c is None else wd - wd_c  # the run's decay the corrected slice drops

        def correct(w: torch.Tensor, d: torch.Tensor) -> None:
            for a, b, off in spans:
                d[a:b].sub_(shift[off : off + b - a])
                if undo:
                    d[a:b].sub_(w[a:b], alpha=undo)

        def finish(y: torch.Tensor, result: LocalResult) -> tuple[Upload, FedPVRClientState]:
            c_new = correction_update(  # Eq. 7, over the steps actually taken
                c_k - c, self.gather(server.x), self.gather(y), result.steps, lr, slice_momentum
            )
            upload = model_upload(y, data, result, weighting=weighting)
            upload.sums["dc"] = c_new - c_k
            return upload, FedPVRClientState(c=c_new)

        if momentum and not self.params.momentum_on_corrected:
            # Momentum on the plain-SGD part only: train without the schedule's momentum and apply
            # it here, the same ops as descend's buffer, then keep the corrected entries' own step.
            keep = self.mask(server.x.device)
            buf: list[torch.Tensor] = []

            def split(w: torch.Tensor, d: torch.Tensor) -> None:
                correct(w, d)
                if not buf:
                    buf.append(d.clone())
                else:
                    buf[0].mul_(momentum).add_(d)
                d.copy_(torch.where(keep, d, buf[0]))

            plain = dataclasses.replace(trainer.schedule, momentum=0.0)
            return LocalTask(server.x, finish, split, schedule=plain)
        return LocalTask(server.x, finish, correct)

    def server_update(
        self, server: FedPVRServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[FedPVRServerState, dict[str, float]]:
        mean = aggregate.sums["x"] / aggregate.weight
        eta_g = self.params.server_lr
        x = mean if eta_g == 1.0 else torch.lerp(server.x, mean, eta_g)  # Eq. 8
        if not self.mask_size:
            return dataclasses.replace(server, x=x), {}
        assert server.c is not None
        c = server.c + aggregate.sums["dc"] / ctx.population.size  # Eq. 9 in SCAFFOLD's |S|/N form
        return FedPVRServerState(x=x, c=c), {}
