"""Run configuration: a typed schema, YAML loading, ``--set`` overrides and up-front validation.

Everything a run needs is checked before any data is read or any process waits on another, so a
typo costs a second, not a queue slot. Unknown keys are refused with the closest valid key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcfl.algorithms.fedcka import FedCKAParams
from hpcfl.algorithms.fedprox import FedProxParams
from hpcfl.algorithms.moon import MoonParams
from hpcfl.errors import ConfigError, suggest


@dataclass
class Stage1Section:
    """TCT stage 1 (FedAvg bootstrap): number of rounds T1 (0 = features at random init)."""

    rounds: int = 10


@dataclass
class Stage2Section:
    """TCT stage 2 (convexified problem); defaults from TCT Algorithm 2 except where noted."""

    p: int = 100_000  # eNTK coordinates kept (paper: 100,000)
    seed: int = 0  # seed of the last-layer re-initialisation and of the coordinate subset
    logit: int = 0  # which logit's gradient gives the features (paper: the first)
    params: str = "all"  # all | features
    lr: float = 5e-5  # η2
    auto_lr: bool = False  # use half the largest stable η2 (from λ_max of every client) instead of lr
    local_steps: int = 500  # M
    rounds: int = 100  # T2
    solver: str = "closed_form"  # closed_form | primal
    variant: str = "scaffold"  # scaffold | fedavg | gd
    loss: str = "mse"  # mse | ce (ce: primal only)
    features: str = "entk"  # entk | last_layer
    normalize: bool = True
    dtype: str = "float32"  # storage dtype of the features
    batch_size: int = 256  # eNTK extraction batch
    method: str = "auto"  # eNTK method: auto | fused | vmap | loop


@dataclass
class Config:
    """One federated run. Field comments are the documentation ``hpcfl run --help`` points to."""

    name: str = "run"
    dataset: str = "fashion-mnist"
    data_root: str | None = None  # else $HPCFL_DATA, else ~/.cache/hpcfl
    download: bool = True
    dataset_options: dict[str, Any] = field(default_factory=dict)  # e.g. synthetic sizes
    partition: str = "iid"  # iid | dir:ALPHA | classes:C | natural
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
    eval_every: int = 1
    eval_train: bool = False
    checkpoint_every: int = 1
    seed: int = 0
    device: str = "cpu"  # cpu | cuda (the GPU of the rank's local index)
    threads: int | None = None  # torch intra-op threads per rank (None: torch's default)
    comm: str = "auto"  # auto | local | mpi
    progress: bool = True
    cka_metrics: bool = False  # per-layer CKA of each client's model vs the global model in metrics rows
    fedprox: FedProxParams = field(default_factory=FedProxParams)
    moon: MoonParams = field(default_factory=MoonParams)
    fedcka: FedCKAParams = field(default_factory=FedCKAParams)
    stage1: Stage1Section = field(default_factory=Stage1Section)
    stage2: Stage2Section = field(default_factory=Stage2Section)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys that may differ when resuming (they change speed or output, not the result).
RESUMABLE_KEYS = frozenset(
    {"rounds", "eval_every", "checkpoint_every", "device", "threads", "comm", "progress"}
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
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        try:
            return float(value)  # YAML 1.1 reads 1e-5 as a string
        except (TypeError, ValueError):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}") from None
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
            raise ConfigError(
                f"unknown config key {full!r}{suggest(full, valid)}; valid keys: {', '.join(valid)}"
            )
        tp = hints[key]
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
    """Recursive dict merge; ``extra`` wins."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, turning every failure into one clear line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.__class__.__name__}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError(f"malformed YAML in {str(path)!r}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}")
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a (possibly partial) dict."""
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply ``--set`` overrides."""
    data = read_yaml(path) if path is not None else {}
    if path is not None and "name" not in data:
        data["name"] = Path(path).stem
    return config_from_dict(merge(data, parse_overrides(overrides)))


def _check_positive(cfg: Any, keys: tuple[str, ...], prefix: str = "") -> None:
    for key in keys:
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"config key {prefix}{key!r} must be > 0, got {value}")


def validate(cfg: Config) -> None:
    """Check every name and range that can be checked without touching data."""
    from hpcfl.algorithms import ALGORITHMS

    _check_positive(cfg, ("num_clients", "batch_size", "eval_every", "checkpoint_every", "local_epochs"))
    _check_positive(cfg, ("local_steps", "threads", "lr"))
    if cfg.rounds < 0:
        raise ConfigError(f"config key 'rounds' must be >= 0, got {cfg.rounds}")
    if cfg.momentum < 0 or cfg.momentum >= 1:
        raise ConfigError(f"config key 'momentum' must be in [0, 1), got {cfg.momentum}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"config key 'weight_decay' must be >= 0, got {cfg.weight_decay}")
    if cfg.device not in ("cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise ConfigError(f"config key 'device' must be cpu or cuda, got {cfg.device!r}")
    if cfg.comm not in ("auto", "local", "mpi"):
        raise ConfigError(f"config key 'comm' must be auto, local or mpi, got {cfg.comm!r}")
    if cfg.algorithm not in ALGORITHMS:
        from hpcfl.errors import unknown

        raise unknown("algorithm", cfg.algorithm, ALGORITHMS)
    _validate_names(cfg)
    s2 = cfg.stage2
    _check_positive(s2, ("p", "lr", "local_steps", "batch_size"), prefix="stage2.")
    if cfg.stage1.rounds < 0 or s2.rounds < 0:
        raise ConfigError("config keys 'stage1.rounds' and 'stage2.rounds' must be >= 0")
    for key, value, choices in (
        ("stage2.params", s2.params, ("all", "features")),
        ("stage2.solver", s2.solver, ("closed_form", "primal")),
        ("stage2.variant", s2.variant, ("scaffold", "fedavg", "gd")),
        ("stage2.loss", s2.loss, ("mse", "ce")),
        ("stage2.features", s2.features, ("entk", "last_layer")),
        ("stage2.dtype", s2.dtype, ("float32", "float16", "bfloat16")),
        ("stage2.method", s2.method, ("auto", "fused", "vmap", "loop")),
    ):
        if value not in choices:
            raise ConfigError(f"config key {key!r} must be one of {', '.join(choices)}, got {value!r}")
    if s2.loss == "ce" and s2.solver == "closed_form":
        raise ConfigError("stage2.loss=ce has no closed form; set stage2.solver=primal")


def _validate_names(cfg: Config) -> None:
    """Dataset, model and partition names, checked against their registries when those exist."""
    from hpcfl.data import canonical_name, parse_partition_spec
    from hpcfl.errors import unknown

    cfg.dataset = canonical_name(cfg.dataset)
    parse_partition_spec(cfg.partition)
    from hpcfl.models import MODELS

    if cfg.model not in MODELS:
        raise unknown("model", cfg.model, MODELS)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    from hpcfl.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between two config dicts (resumable keys ignored)."""
    diffs: list[str] = []
    for key in sorted(set(saved) | set(current)):
        full = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key not in ("model_options", "dataset_options"):
            diffs += config_differences(a, b, prefix=f"{full}.")
        elif a != b and full not in RESUMABLE_KEYS:
            diffs.append(full)
    return diffs
