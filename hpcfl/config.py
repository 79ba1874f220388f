"""Run configuration: a typed schema, YAML loading, ``--set`` overrides and up-front validation.

Everything a run needs is checked before any data is read or any process waits on another, so a
typo costs a second, not a queue slot. Unknown keys are refused with the closest valid key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcfl.algorithms.asynchronous import AsyncAlgorithm
from hpcfl.algorithms.base import HyperParams
from hpcfl.algorithms.system import SystemSection, validate_system
from hpcfl.entk.settings import EntkSection
from hpcfl.errors import ConfigError, suggest
from hpcfl.files import read_yaml as read_yaml  # where it lives (light); named here for callers
from hpcfl.privacy.section import PrivacySection, validate_privacy
from hpcfl.registry import ALGORITHMS, MODEL_SPECS, import_modules
from hpcfl.units import as_integer, parse_client_batch, parse_memory_budget


@dataclass
class FinetuneEval:
    """``finetune_eval``: the global model fine-tuned on each evaluated client's training data for
    ``steps`` plain SGD steps at ``lr`` (batch size and weight decay of the run), then evaluated on the
    client's ``client_eval`` share ("FedAvg + local fine-tuning"); ``rounds``: ``every`` evaluated
    round or only the ``last``. ``steps: 0`` turns it off. Never changes the trajectory. TCT's
    stage 2 fine-tunes its linear model with ``steps`` local steps of the client's stage-2 solver at
    stage 2's own η2 instead (:func:`hpcfl.tct.pipeline.prepare_stage2`)."""

    steps: int = 0
    lr: float = 0.01
    rounds: str = "every"  # every | last


@dataclass
class Config:
    """One federated run. Field comments are the documentation ``hpcfl run --help`` points to."""

    name: str = "run"
    imports: list[str] = field(default_factory=list)  # modules imported first (plugins that register names)
    dataset: str = "fashion-mnist"
    data_root: str | None = None  # else $HPCFL_DATA, else ~/.cache/hpcfl
    download: bool = True
    dataset_options: dict[str, Any] = field(default_factory=dict)  # e.g. synthetic sizes
    partition: str = "iid"  # iid | dir:ALPHA | client-dir:ALPHA | classes:C | balanced-classes:C | natural
    num_clients: int = 10
    min_client_size: int = 10  # dir:ALPHA redraws until every client has this many samples
    model: str = "simplecnn"
    model_options: dict[str, Any] = field(default_factory=dict)
    algorithm: str = "fedavg"
    rounds: int = 10
    local_epochs: int = 1
    local_steps: int | None = None  # when set, M local steps replace local_epochs
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 1e-5
    batch_size: int = 64
    drop_last: bool = False  # drop each epoch's last partial batch: E·⌊n/B⌋ local steps (FedPVR's code)
    eval_every: int = 1
    eval_train: bool = False
    # auto | N: checkpoint every N rounds (server steps). auto = 1 for synchronous methods; for an
    # asynchronous one, every concurrency / K steps, since its checkpoint holds every update in flight
    checkpoint_every: str = "auto"
    seed: int = 0
    device: str = "cpu"  # cpu | cuda (the GPU of the rank's local index)
    threads: int | None = None  # torch intra-op threads per rank (None: torch's default)
    comm: str = "auto"  # auto | local | mpi
    # auto | SECONDS: the deadline of every collective under MPI: past it, the waiting rank knocks on the
    # others' side channel and keeps waiting while all answer (slow is not lost); a rank silent to two
    # knocks (its node lost, its link cut) ends the job with one line and exit 76 (requeue / --resume)
    # within SECONDS + 3 x SECONDS/4 (0.5..10 s). auto = 20 s (noticed within 35 s); $HPCFL_COMM_TIMEOUT overrides
    comm_timeout: str = "auto"
    progress: bool = True
    cka_metrics: bool = False  # per-layer CKA of each client's model vs the global model in metrics rows
    drift_diversity: bool = (
        False  # per-layer drift diversity ξ of the client updates (FedPVR Eq. 2) in metrics rows
    )
    conformal: bool = False  # split-conformal LAC/APS coverage and set size (1-α = 0.9/0.95/0.99) per row
    conformal_calibration: float = 0.5  # fraction of the test set that calibrates; the rest measures
    validation: float = 0.0  # share of each client's training samples held out (seeded) as val_accuracy
    clients_per_round: int | None = None  # partial participation: N clients sampled per round
    participation: float | None = None  # or a fraction of the clients per round (rounded, >= 1)
    participation_weighting: str = "uniform"  # uniform | size (probability proportional to n_k)
    reduction: str = "float64"  # float64: the round's sum is placement-independent | float32: half the bytes
    client_state_memory: str = "auto"  # auto | memory | disk | a byte budget, e.g. 2GB
    client_batch: str = (
        "auto"  # participants as one vectorised step: auto (1 on a CPU, sized on a GPU) | 1 | N
    )
    # CPU: participants a rank trains at once in Python threads, each with threads // client_threads
    # torch threads (a small model's step does not fill the cores; hpcfl.runner.executor)
    client_threads: int = 1
    client_eval: float = 0.0  # share of each client's data held out (seeded) for per-client accuracy
    client_eval_clients: int | None = None  # evaluate a seeded sample of M clients per row (None: all)
    finetune_eval: FinetuneEval = field(default_factory=lambda: FinetuneEval())  # personalised accuracy
    # N of the num_clients clients (seeded, listed in the run's record) never train nor take part: each
    # evaluation scores the global model on their data (heldout_accuracy) and, for a personalised
    # algorithm with client_eval, each one's own adaptation (heldout_personal_accuracy)
    heldout_clients: int = 0
    loggers: list[str] = field(default_factory=list)  # tensorboard | mlflow | wandb: views of metrics.jsonl
    params: Any = None  # the algorithm's hyper-parameters (its frozen Params dataclass)
    privacy: PrivacySection = field(default_factory=PrivacySection)  # differential privacy (hpcfl.privacy)
    system: SystemSection = field(default_factory=SystemSection)  # unequal work, stragglers, dropout
    entk: EntkSection = field(default_factory=EntkSection)  # eNTK path: costs, CUDA graphs, autotune

    def __post_init__(self) -> None:
        if self.params is None:
            cls = ALGORITHMS.get(self.algorithm)
            self.params = cls.Params() if cls is not None else HyperParams()

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML values (tuples become lists, as YAML reads them back)."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def legacy_sections() -> dict[str, str]:
    """Config sections that hold one built-in algorithm's params → that algorithm: a section named
    after the algorithm (``tct: {stage2: {p: 2000}}``: the base config of a sweep over several
    algorithms scopes each one's params so, as the grid's ``tct.stage2.p`` axes do; the sections of
    the other algorithms are validated and dropped), and those written before ``params:`` existed
    (declared by the algorithms, :attr:`hpcfl.algorithms.Algorithm.legacy_sections`)."""
    names = ALGORITHMS.builtin_names()
    own = {name: name for name in names}
    return own | {section: name for name in names for section in ALGORITHMS[name].legacy_sections}


def _legacy_target(owner: str, key: str) -> tuple[type, bool]:
    """(the dataclass a legacy section ``key`` of algorithm ``owner`` builds, whether it is a field
    of the params rather than the params themselves)."""
    params_cls = ALGORITHMS[owner].Params
    if key in {f.name for f in dataclasses.fields(params_cls)}:
        return type(getattr(params_cls(), key)), True
    return params_cls, False


def _validate_legacy(owner: str, key: str, value: Any) -> None:
    cls, _ = _legacy_target(owner, key)
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(f"config key {key!r} must be a mapping of {cls.__name__} options")
    _build(cls, value, prefix=f"{key}.")


def _both_set(section: Any, params: Any, prefix: str = "") -> list[str]:
    """The dotted keys a legacy section and ``params`` both set, to different values."""
    if not isinstance(section, dict) or not isinstance(params, dict):
        return [] if section is None or params is None or section == params else [prefix.rstrip(".")]
    out = []
    for key in section.keys() & params.keys():
        a, b = section[key], params[key]
        if isinstance(a, dict) and isinstance(b, dict):
            out += _both_set(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return sorted(out)


def params_prefix(sources: Sequence[dict[str, Any]], algorithm: str) -> str:
    """How the user named the running algorithm's hyper-parameters, for error messages: ``params.``
    unless every source gives them through one legacy section alone (``fedprox: {mu: ..}`` →
    ``fedprox.``; a section that is a params field, TCT's ``stage2:``, → no prefix), so an error in
    that section names the key the user wrote."""
    named = set()
    for source in sources:
        if "params" in source:
            return "params."
        for key, owner in legacy_sections().items():
            if owner == algorithm and key in source:
                named.add("" if _legacy_target(owner, key)[1] else f"{key}.")
    return named.pop() if len(named) == 1 else "params."


def migrate(data: dict[str, Any], algorithm: str | None = None) -> dict[str, Any]:
    """Move the legacy per-algorithm sections into ``params`` (those of other algorithms are
    dropped: older run directories saved every section, used or not)."""
    data = dict(data)
    algorithm = algorithm or str(data.get("algorithm", Config.algorithm))
    if not isinstance(data.get("params") or {}, dict):
        raise ConfigError(
            f"config key 'params' must be a mapping of {algorithm} hyper-parameters, got {data['params']!r}"
        )
    params = dict(data.get("params") or {})
    for key, owner in legacy_sections().items():
        if key not in data:
            continue
        value = data.pop(key)
        if algorithm != owner:
            _validate_legacy(owner, key, value)  # unused here, but a typo is still named
            continue
        field = _legacy_target(owner, key)[1]
        both = _both_set(value, params.get(key) if field else params)
        if both:
            shown = ", ".join(f"params.{key + '.' if field else ''}{k}" for k in both)
            raise ConfigError(
                f"config sets {shown} both in params: and in the {key}: section, with different values; "
                f"give each once (the {key}: section's value would be silently overridden)"
            )
        if field:
            params[key] = merge(value or {}, params.get(key) or {}) if isinstance(value, dict) else value
        elif isinstance(value, dict):
            params = merge(value, params)
        else:
            raise ConfigError(f"config key {key!r} must be a mapping of {algorithm} options")
    if params or "params" in data:
        data["params"] = params
    return data


# Keys that may differ when resuming (they change speed or output, not the result).
RESUMABLE_KEYS = frozenset(
    {
        "rounds",
        "eval_every",
        "checkpoint_every",
        "device",
        "threads",
        "comm",
        "comm_timeout",
        "progress",
        "client_state_memory",
        "client_batch",  # results equal to float32 rounding (not bit for bit) across values
        "client_threads",  # the torch threads of a client's kernels: noted by the run's record
        "conformal",
        "conformal_calibration",
        "loggers",  # views of metrics.jsonl
        "client_eval_clients",  # which clients are evaluated, not what trains
        "finetune_eval.steps",  # fine-tunes copies, never the trajectory
        "finetune_eval.lr",
        "finetune_eval.rounds",
        "entk.costs",  # the eNTK path's implementation: rounding only, noted by the run's record
        "entk.cuda_graph",
        "entk.triton_autotune",
        "entk.native",
    }
)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type, or raise a ConfigError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        return _coerce(value, args[0], key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if tp is int:
        number = as_integer(value)
        if number is None:
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return number
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        try:
            number = float(value)  # YAML 1.1 reads 1e-5 as a string
        except (TypeError, ValueError):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}") from None
        if not math.isfinite(number):  # .nan would pass every range check and fail rounds later
            raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in hints:
            valid = [f"{prefix}{n}" for n in names]
            if not valid:
                raise ConfigError(f"unknown config key {full!r}: {prefix.rstrip('.')} takes no keys")
            raise ConfigError(
                f"unknown config key {full!r}{suggest(full, valid)}; valid keys: {', '.join(valid)}"
            )
        tp = hints[key]
        if cls is Config and key == "params":
            continue  # built by config_from_dict once the algorithm is known
        if _is_section(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"config key {full!r} must be a mapping of {tp.__name__} options")
            kwargs[key] = _build(tp, value, prefix=f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``extra`` wins, and an empty mapping in ``extra`` clears the section
    (``--set params={}`` drops the YAML file's params: the algorithm's defaults apply)."""
    out = dict(base)
    for k, v in extra.items():
        nested = isinstance(v, dict) and v and isinstance(out.get(k), dict)
        out[k] = merge(out[k], v) if nested else v
    return out


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a (possibly partial) dict.

    ``params`` is validated against the algorithm's frozen Params dataclass (unknown key: the
    closest valid one; wrong type: one line); legacy sections are migrated first.
    """
    import_modules(data.get("imports"))
    prefix = params_prefix([data], str(data.get("algorithm", Config.algorithm)))
    return _config_from(migrate(data), prefix)


def _config_from(data: dict[str, Any], prefix: str) -> Config:
    """:func:`config_from_dict` of a migrated dict; ``prefix``: :func:`params_prefix`."""
    cfg = _build(Config, data)
    if cfg.algorithm not in ALGORITHMS:
        from hpcfl.errors import unknown

        raise unknown("algorithm", cfg.algorithm, ALGORITHMS)
    raw = data.get("params") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config key 'params' must be a mapping of {cfg.algorithm} hyper-parameters")
    if raw and not dataclasses.fields(ALGORITHMS[cfg.algorithm].Params):
        raise ConfigError(
            f"config key 'params' must be empty: {cfg.algorithm} takes no hyper-parameters, got "
            f"{', '.join(map(str, raw))} (--set params={{}} clears a config file's params)"
        )
    try:
        cfg.params = _build(ALGORITHMS[cfg.algorithm].Params, raw, prefix="params.")
    except ConfigError as err:
        if prefix == "params.":
            raise
        raise ConfigError(
            str(err).replace("'params.", f"'{prefix}").replace(" params.", f" {prefix}")
        ) from None
    validate(cfg)
    return cfg


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "c": 2}`` → ``{"a": {"b": 1}, "c": 2}`` (dotted keys as ``--set`` reads them)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {key}: {part!r} is not a section")
        node[parts[-1]] = value
    return out


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, values: dict[str, Any] | None = None
) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply ``--set`` overrides,
    then ``values`` (already-typed ``{dotted key: value}``, e.g. a sweep point's)."""
    data = read_yaml(path) if path is not None else {}
    if path is not None and "name" not in data:
        data["name"] = Path(path).stem
    extra = merge(parse_overrides(overrides), nest(values or {}))
    algorithm = str(extra.get("algorithm", data.get("algorithm", Config.algorithm)))
    merged = merge(migrate(data, algorithm), migrate(extra, algorithm))
    import_modules(merged.get("imports"))
    return _config_from(migrate(merged), params_prefix([data, extra], algorithm))


def load_cli_config(
    path: str | Path | None, sets: list[str], data_root: str | None, values: dict[str, Any] | None = None
) -> Config:
    """The validated config of ``path`` with ``--set`` and ``--data-root`` applied (``run``,
    ``compare``, ``submit`` and every sweep point load their config so).

    The data root (from the flag or the file) is made absolute here, where it enters, so a relative
    one keeps naming the same directory after a launcher or a job changes the working directory.
    ``values`` are typed ``{dotted key: value}`` overrides applied after ``sets`` (a sweep point's).
    """
    from hpcfl.data.root import absolute_data_root

    overrides = list(sets) + ([f"data_root={data_root}"] if data_root else [])
    cfg = load_config(path, overrides, values)
    cfg.data_root = absolute_data_root(cfg.data_root)
    return cfg


#: Seeds are in [0, 2**63): what ``torch.manual_seed`` and numpy's ``SeedSequence`` both take.
MAX_SEED = 2**63 - 1


def check_seed(value: Any, key: str) -> None:
    """Refuse a seed that is not an integer in [0, :data:`MAX_SEED`] (``1e30`` overflowed in torch)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        shown = f"{value:.6g}" if isinstance(value, int) and abs(value) > MAX_SEED else repr(value)
        raise ConfigError(f"config key {key!r} must be an integer in [0, 2**63 - 1], got {shown}")


def _check_positive(cfg: Any, keys: tuple[str, ...], prefix: str = "") -> None:
    for key in keys:
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"config key {prefix}{key!r} must be > 0, got {value}")


def validate(cfg: Config) -> None:
    """Check every name and range that can be checked without touching data."""
    _validate_run_name(cfg.name)
    _check_positive(cfg, ("num_clients", "batch_size", "eval_every", "local_epochs"))
    parse_client_batch(cfg.checkpoint_every, "checkpoint_every")  # the same form: auto | N >= 1
    _check_positive(cfg, ("local_steps", "threads", "client_threads", "lr"))
    if cfg.rounds < 0:
        raise ConfigError(f"config key 'rounds' must be >= 0, got {cfg.rounds}")
    check_seed(cfg.seed, "seed")
    if cfg.momentum < 0 or cfg.momentum >= 1:
        raise ConfigError(f"config key 'momentum' must be in [0, 1), got {cfg.momentum}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"config key 'weight_decay' must be >= 0, got {cfg.weight_decay}")
    if cfg.device not in ("cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise ConfigError(f"config key 'device' must be cpu or cuda, got {cfg.device!r}")
    if cfg.comm not in ("auto", "local", "mpi"):
        raise ConfigError(f"config key 'comm' must be auto, local or mpi, got {cfg.comm!r}")
    from hpcfl.comm.deadline import parse_timeout

    parse_timeout(cfg.comm_timeout)
    if cfg.algorithm not in ALGORITHMS:
        from hpcfl.errors import unknown

        raise unknown("algorithm", cfg.algorithm, ALGORITHMS)
    _validate_names(cfg)
    if cfg.clients_per_round is not None and cfg.participation is not None:
        raise ConfigError("set only one of 'clients_per_round' and 'participation'")
    if cfg.clients_per_round is not None and not 1 <= cfg.clients_per_round:
        raise ConfigError(f"config key 'clients_per_round' must be >= 1, got {cfg.clients_per_round}")
    if not 0 < cfg.conformal_calibration < 1:
        raise ConfigError(
            f"config key 'conformal_calibration' must be in (0, 1) (the test-set fraction that calibrates), "
            f"got {cfg.conformal_calibration}"
        )
    if not 0 <= cfg.validation < 1:
        raise ConfigError(
            f"config key 'validation' must be in [0, 1) (the share of each client's training data held "
            f"out), got {cfg.validation}"
        )
    if cfg.participation is not None and not 0 < cfg.participation <= 1:
        raise ConfigError(f"config key 'participation' must be in (0, 1], got {cfg.participation}")
    for key, value, choices in (
        ("participation_weighting", cfg.participation_weighting, ("uniform", "size")),
        ("reduction", cfg.reduction, ("float64", "float32")),
    ):
        if value not in choices:
            raise ConfigError(f"config key {key!r} must be one of {', '.join(choices)}, got {value!r}")
    parse_memory_budget(cfg.client_state_memory)
    if cfg.client_threads > 1 and cfg.device != "cpu":
        raise ConfigError(
            f"config key 'client_threads' ({cfg.client_threads}) is for the CPU; on {cfg.device} "
            "train a round's clients together with client_batch"
        )
    if cfg.client_threads > 1 and parse_client_batch(cfg.client_batch) not in ("auto", 1):
        raise ConfigError(
            f"config keys client_batch ({cfg.client_batch}) and client_threads ({cfg.client_threads}) "
            "are two ways to train a round's clients at once; set one"
        )
    parse_client_batch(cfg.client_batch)
    validate_privacy(cfg.privacy, cfg)
    if cfg.system.dropout.trace is not None:  # absolute where it enters, as the data root
        cfg.system.dropout.trace = str(Path(cfg.system.dropout.trace).expanduser().resolve())
    if cfg.system.clock.trace is not None:
        cfg.system.clock.trace = str(Path(cfg.system.clock.trace).expanduser().resolve())
    validate_system(
        cfg.system,
        num_clients=cfg.num_clients,
        local_epochs=cfg.local_epochs,
        local_steps=cfg.local_steps,
        private=cfg.privacy.enabled,
        asynchronous=issubclass(ALGORITHMS[cfg.algorithm], AsyncAlgorithm),
    )
    _validate_evaluation(cfg)
    _check_against_dataset(cfg)


# (classes, training samples) of each dataset, known without reading it (femnist: natural clients).
_DATASET_SIZES = {"mnist": (10, 60_000), "fashion-mnist": (10, 60_000), "cifar10": (10, 50_000)}
_DATASET_SIZES["cifar100"] = (100, 50_000)


def _check_against_dataset(cfg: Config) -> None:
    """What the dataset's size and class count already rule out, checked before any data is read."""
    from hpcfl.data import parse_partition_spec

    if cfg.dataset == "synthetic":
        from hpcfl.data.synthetic import synthetic_options

        try:
            n_train, _, classes, *_ = synthetic_options(**cfg.dataset_options)
        except TypeError:
            return  # an unknown option: load_dataset names it with the valid ones
    elif cfg.dataset in _DATASET_SIZES:
        classes, n_train = _DATASET_SIZES[cfg.dataset]
    else:
        return
    kind, param = parse_partition_spec(cfg.partition)
    if kind in ("classes", "balanced-classes") and isinstance(param, int) and param > classes:
        raise ConfigError(
            f"partition {cfg.partition!r} asks for {param} classes per client but {cfg.dataset} has "
            f"{classes}; use {kind}:C with C <= {classes}"
        )
    if cfg.num_clients > n_train:
        raise ConfigError(
            f"num_clients={cfg.num_clients} is more than the {n_train} training samples of {cfg.dataset}; "
            "use fewer clients"
        )
    if isinstance(cfg.params, HyperParams):
        cfg.params.check_data(cfg.dataset, classes)


LOGGERS = ("tensorboard", "mlflow", "wandb")


def _validate_evaluation(cfg: Config) -> None:
    """``loggers``, ``client_eval``, ``client_eval_clients``, ``finetune_eval`` and ``heldout_clients``."""
    if not isinstance(cfg.loggers, list) or any(name not in LOGGERS for name in cfg.loggers):
        raise ConfigError(f"config key 'loggers' must be a list of {', '.join(LOGGERS)}, got {cfg.loggers!r}")
    if not 0 <= cfg.client_eval < 1:
        raise ConfigError(
            f"config key 'client_eval' must be in [0, 1) (the share of each client's data held out for "
            f"per-client evaluation), got {cfg.client_eval}"
        )
    _check_positive(cfg, ("client_eval_clients",))
    ft = cfg.finetune_eval
    if ft.steps < 0:
        raise ConfigError(f"config key 'finetune_eval.steps' must be >= 0, got {ft.steps}")
    _check_positive(ft, ("lr",), prefix="finetune_eval.")
    if ft.rounds not in ("every", "last"):
        raise ConfigError(f"config key 'finetune_eval.rounds' must be every or last, got {ft.rounds!r}")
    if (cfg.client_eval_clients is not None or ft.steps > 0) and cfg.client_eval == 0:
        raise ConfigError(
            "client_eval_clients and finetune_eval evaluate on each client's held-out share: set "
            "client_eval (e.g. 0.1) too"
        )
    if not 0 <= cfg.heldout_clients < cfg.num_clients:
        raise ConfigError(
            f"config key 'heldout_clients' must be in [0, num_clients) (at least one client trains), got "
            f"{cfg.heldout_clients} with num_clients {cfg.num_clients}"
        )


def _validate_run_name(name: str) -> None:
    """A run name becomes a directory (``runs/<name>``) and a SLURM job name: one plain path part."""
    bad = [c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127]
    if not name.strip() or name in (".", "..") or bad or name.startswith("-"):
        raise ConfigError(
            f"config key 'name' must be a plain file name (no '/', '\\', newline or control "
            f"character, not '.', '..' or starting with '-'), got {name!r}"
        )


def _validate_names(cfg: Config) -> None:
    """Dataset, model and partition names, checked against their registries when those exist."""
    from hpcfl.data import canonical_name, parse_partition_spec
    from hpcfl.errors import unknown

    cfg.dataset = canonical_name(cfg.dataset)
    parse_partition_spec(cfg.partition)
    if cfg.model not in MODEL_SPECS:
        raise unknown("model", cfg.model, MODEL_SPECS)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    from hpcfl.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between two config dicts (resumable keys ignored)."""
    if not prefix:
        saved, current = migrate(saved), migrate(current)
        # a key added to the schema after the run was saved reads as its default (older run
        # directories stay resumable as long as the new key keeps that default)
        defaults = Config().to_dict()
        saved = {**{k: v for k, v in defaults.items() if k not in saved and k in current}, **saved}
    diffs: list[str] = []
    for key in sorted(set(saved) | set(current)):
        full = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key not in ("model_options", "dataset_options"):
            diffs += config_differences(a, b, prefix=f"{full}.")
        elif a != b and full not in RESUMABLE_KEYS:
            diffs.append(full)
    return diffs
