"""The registry of algorithms, models and datasets: built-ins by name, plugins found on demand.

Four :class:`Registry` mappings, name → object, that import nothing until a name is looked up
(this module imports neither torch nor any algorithm, so importing it is free):

- :data:`ALGORITHMS`: name → :class:`hpcfl.algorithms.Algorithm` subclass;
- :data:`MODEL_SPECS`: name → :class:`ModelSpec` (how :func:`hpcfl.build_model` builds it);
- :data:`DATASET_SPECS`: name → :class:`DatasetSpec` (how :func:`hpcfl.load_dataset` loads it);
- :data:`STAGE_HOOKS`: name → the stage code an algorithm's :class:`~hpcfl.algorithms.Stage` names.

This module is the one place that names modules by string (its built-in tables): those imports
happen when a name is looked up, never when a module is imported, and ``tests/import_graph.py``
lists them apart from the import edges and checks that each resolves.

A name that is not built in comes from, in this order: :func:`register_algorithm` /
:func:`register_model` / :func:`register_dataset` (a notebook or script, this process only), a
module named in a config's ``imports:`` list that calls them (imported in every process that reads
the config: sweep workers, MPI ranks, SLURM jobs), or an installed distribution's entry point in the
group ``hpcfl.algorithms`` / ``hpcfl.models`` / ``hpcfl.datasets`` (found through
``importlib.metadata`` by any process, imported only when its name is used). A plugin name that
clashes with a built-in, or an entry point that fails to import, is one :class:`ConfigError` line
naming the distribution and the cause.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from hpcfl.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from hpcfl.algorithms.base import Algorithm
    from hpcfl.data.types import Dataset

T = TypeVar("T")

__all__ = [
    "ALGORITHMS",
    "DATASET_SPECS",
    "MODEL_SPECS",
    "STAGE_HOOKS",
    "DatasetSpec",
    "ModelSpec",
    "Registry",
    "import_modules",
    "register_algorithm",
    "register_dataset",
    "register_model",
    "register_stage_hook",
]


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model.

    ``build(input_shape, num_classes, **options) -> nn.Module`` (``input_shape`` = (C, H, W));
    ``options`` maps each option the model accepts to a validator ``(model_name, value) -> value``
    that raises :class:`ConfigError` on a bad value; ``min_side`` is the smallest image side;
    ``flat_inputs``: the model flattens its input into an ``nn.Linear`` first layer named ``fc1``
    (NTK-FL's memory guard counts that layer apart; CP-NTK-FL projects such inputs);
    ``text``: the model reads symbol codes ``(B, L)`` of a text dataset, whose vocabulary
    :func:`hpcfl.build_model` checks against the model's (an image model refuses text and back).
    """

    build: Callable[..., nn.Module]
    options: Mapping[str, Callable[[str, Any], Any]] = field(default_factory=dict)
    min_side: int = 1
    flat_inputs: bool = False
    text: bool = False


@dataclass(frozen=True)
class DatasetSpec:
    """How to load one dataset.

    ``load(name, root, download, **options) -> Dataset``: ``root`` is the resolved data directory
    (a :class:`pathlib.Path`), ``download`` whether fetching missing files is allowed; ``options``
    names the keyword options it accepts (a config's ``dataset_options``).
    """

    load: Callable[..., Dataset]
    options: tuple[str, ...] = ()


def _attr(module: str, attr: str, key: str | None = None) -> Callable[[], Any]:
    """A loader of ``module.attr`` (or ``module.attr[key]``), imported on the first call."""

    def load() -> Any:
        obj = getattr(importlib.import_module(module), attr)
        return obj if key is None else obj[key]

    return load


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None else "?"


class Registry(Mapping[str, T], Generic[T]):
    """Name → object for one kind (``algorithm``, ``model``, ``dataset``), loaded lazily.

    Built-ins are loaders by name (the names are known without importing anything); entry points
    of ``group`` are scanned once per process (metadata only) and loaded when their name is used;
    ``check(name, obj, origin)`` validates a plugin object (and may normalise it) with one line.
    Iterating lists every name without importing anything.
    """

    def __init__(
        self,
        kind: str,
        group: str,
        builtins: Mapping[str, Callable[[], T]],
        check: Callable[[str, Any, str], T],
    ) -> None:
        self.kind = kind
        self.group = group
        self._builtins = dict(builtins)
        self._check = check
        self._loaded: dict[str, T] = {}
        self._registered: dict[str, T] = {}
        self._entry_points: dict[str, metadata.EntryPoint] | None = None

    # -- names -------------------------------------------------------------------------------
    def builtin_names(self) -> tuple[str, ...]:
        """The built-in names, in their registry order."""
        return tuple(self._builtins)

    def plugins(self) -> dict[str, metadata.EntryPoint]:
        """The group's entry points by name (scanned once; a clash is one :class:`ConfigError`)."""
        if self._entry_points is None:
            found: dict[str, metadata.EntryPoint] = {}
            for ep in metadata.entry_points(group=self.group):
                dist = _distribution(ep)
                if ep.name in self._builtins:
                    raise ConfigError(
                        f"plugin {self.kind} {ep.name!r} of distribution {dist!r} (entry point group "
                        f"{self.group}) clashes with the built-in {self.kind} of that name; rename it"
                    )
                other = found.get(ep.name)
                if other is not None and other.value != ep.value:
                    raise ConfigError(
                        f"plugin {self.kind} {ep.name!r} is declared by distributions {_distribution(other)!r} "
                        f"and {dist!r} (entry point group {self.group}); uninstall or rename one"
                    )
                found[ep.name] = ep
            self._entry_points = found
        return self._entry_points

    def refresh(self) -> None:
        """Forget the scanned entry points (after ``sys.path`` changed) and the plugins loaded
        from them; registrations stay."""
        self._entry_points = None
        for name in [n for n in self._loaded if n not in self._builtins]:
            del self._loaded[name]
        importlib.invalidate_caches()

    def __iter__(self) -> Iterator[str]:
        seen = dict.fromkeys([*self._builtins, *self._registered, *sorted(self.plugins())])
        return iter(seen)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        self.plugins()  # a clash is reported whatever name is asked for
        return isinstance(name, str) and (
            name in self._builtins or name in self._registered or name in self.plugins()
        )

    # -- objects -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        self.plugins()
        if name in self._registered:
            return self._registered[name]
        if name in self._loaded:
            return self._loaded[name]
        if name in self._builtins:
            obj = self._builtins[name]()
        else:
            ep = self.plugins().get(name)
            if ep is None:
                raise KeyError(name)
            origin = f"plugin {self.kind} {name!r} of distribution {_distribution(ep)!r}"
            try:
                loaded = ep.load()
            except Exception as err:  # noqa: BLE001 - any import failure is the plugin's, said in one line
                raise ConfigError(f"{origin} failed to import ({ep.value}): {_first_line(err)}") from None
            obj = self._check(name, loaded, origin)
        self._loaded[name] = obj
        return obj

    def register(self, name: str, obj: Any) -> T:
        """Make ``obj`` available as ``name`` in this process (a built-in name is refused)."""
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"a registered {self.kind} needs a non-empty name, got {name!r}")
        if name in self._builtins:
            raise ConfigError(
                f"register_{self.kind}: {name!r} is a built-in {self.kind}; choose another name"
            )
        checked = self._check(name, obj, f"register_{self.kind}({name!r})")
        self._registered[name] = checked
        return checked


# -- the three registries ----------------------------------------------------------------------


def _check_algorithm(name: str, obj: Any, origin: str) -> type[Algorithm]:
    # The contract is looked up, not imported: a class can only subclass Algorithm once
    # hpcfl.algorithms.base has been imported, so a missing module means "not an Algorithm". The
    # registry thus stays below the contract that re-exports it, with no import back up (issue 43).
    contract = sys.modules.get("hpcfl.algorithms.base")
    if contract is None or not (isinstance(obj, type) and issubclass(obj, contract.Algorithm)):
        raise ConfigError(f"{origin} is {obj!r}, not a subclass of hpcfl.algorithms.Algorithm")
    HyperParams = contract.HyperParams
    if getattr(obj, "name", None) != name:
        raise ConfigError(
            f"{origin}: class {obj.__name__} has name {getattr(obj, 'name', None)!r}; "
            f"its name and the registered name must agree"
        )
    if not (isinstance(obj.Params, type) and issubclass(obj.Params, HyperParams)):
        raise ConfigError(f"{origin}: {obj.__name__}.Params must be a frozen HyperParams dataclass")
    levels = obj.dp_levels
    if not (isinstance(levels, tuple) and set(levels) <= {"client", "sample"}):
        raise ConfigError(
            f"{origin}: {obj.__name__}.dp_levels must be a tuple of 'client'/'sample', got {levels!r}"
        )
    return obj


def _check_hook(name: str, obj: Any, origin: str) -> Callable[..., Any]:
    if not callable(obj):
        raise ConfigError(f"{origin} is {obj!r}, not a function")
    return obj


def _check_model(name: str, obj: Any, origin: str) -> ModelSpec:
    if isinstance(obj, ModelSpec):
        return obj
    if callable(obj):
        return ModelSpec(obj)
    raise ConfigError(f"{origin} is {obj!r}, not a ModelSpec or a build(input_shape, num_classes) callable")


def _check_dataset(name: str, obj: Any, origin: str) -> DatasetSpec:
    if name != name.strip().lower():
        raise ConfigError(f"{origin}: dataset names are lower case without spaces")
    if isinstance(obj, DatasetSpec):
        return obj
    if callable(obj):
        return DatasetSpec(obj)
    raise ConfigError(f"{origin} is {obj!r}, not a DatasetSpec or a load(name, root, download) callable")


#: Built-in algorithms: adding one is its module and one line here.
ALGORITHMS: Registry[type[Algorithm]] = Registry(
    "algorithm",
    "hpcfl.algorithms",
    {
        name: _attr(f"hpcfl.algorithms.{module}", cls)
        for name, module, cls in (
            ("fedavg", "fedavg", "FedAvg"),
            ("fedprox", "fedprox", "FedProx"),
            ("scaffold", "scaffold", "Scaffold"),
            ("tct", "tct", "TCT"),
            ("moon", "moon", "Moon"),
            ("fedcka", "fedcka", "FedCKA"),
            ("fedpvr", "fedpvr", "FedPVR"),
            ("feddyn", "feddyn", "FedDyn"),
            ("fednova", "fednova", "FedNova"),
            ("fedadam", "fedadam", "FedAdam"),
            ("fedyogi", "fedyogi", "FedYogi"),
            ("fedadagrad", "fedadagrad", "FedAdagrad"),
            ("fedavgm", "fedavgm", "FedAvgM"),
            ("ntkfl", "ntkfl", "NTKFL"),
            ("cp-ntkfl", "cp_ntkfl", "CPNTKFL"),
            ("fedbn", "fedbn", "FedBN"),
            ("fedper", "fedper", "FedPer"),
            ("fedrep", "fedrep", "FedRep"),
            ("ditto", "ditto", "Ditto"),
            ("apfl", "apfl", "APFL"),
            ("fedbabu", "fedbabu", "FedBABU"),
            ("feduv", "feduv", "FedUV"),
            ("fedbuff", "fedbuff", "FedBuff"),
            ("fedasync", "fedasync", "FedAsync"),
        )
    },
    _check_algorithm,
)

#: Stage hooks by name (:class:`hpcfl.algorithms.Stage`'s ``enter``/``check``/``finish``): an
#: algorithm names its stage code, which sits above the contract and imports it, so the algorithm
#: never imports that code; the runner resolves the name here when it calls the hook. Built-ins
#: are ``<algorithm>.<step>``; a plugin adds its own through the entry point group
#: ``hpcfl.stage_hooks`` or :func:`register_stage_hook` (or passes a function itself).
STAGE_HOOKS: Registry[Callable[..., Any]] = Registry(
    "stage hook",
    "hpcfl.stage_hooks",
    {
        "tct.keep_stage1_model": _attr("hpcfl.tct.pipeline", "keep_stage1_model"),
        "tct.enter_stage2": _attr("hpcfl.tct.pipeline", "enter_stage2"),
        "tct.check_features_fit": _attr("hpcfl.tct.features", "check_features_fit"),
        "ntkfl.enter": _attr("hpcfl.ntk.stage", "enter_ntk"),
    },
    _check_hook,
)

MODEL_SPECS: Registry[ModelSpec] = Registry(
    "model",
    "hpcfl.models",
    {
        name: _attr("hpcfl.models", "BUILTIN_MODELS", name)
        for name in (
            "simplecnn",
            "mlp",
            "cnn-proj",
            "resnet8",
            "resnet18",
            "vgg11",
            "char-lstm",
            "char-transformer",
        )
    },
    _check_model,
)

DATASET_SPECS: Registry[DatasetSpec] = Registry(
    "dataset",
    "hpcfl.datasets",
    {
        name: _attr("hpcfl.data.registry", "BUILTIN_DATASETS", name)
        for name in ("mnist", "fashion-mnist", "cifar10", "cifar100", "femnist", "shakespeare", "synthetic")
    },
    _check_dataset,
)


def register_algorithm(cls: type[Algorithm], name: str | None = None) -> type[Algorithm]:
    """Make the :class:`~hpcfl.algorithms.Algorithm` subclass ``cls`` usable by its ``name`` in
    this process (``hpcfl.run_experiment``, configs read here). Returns ``cls``, so it also works
    as a class decorator. Other processes (sweep workers, MPI ranks, SLURM jobs) see it through an
    entry point or a config's ``imports:`` module that calls this."""
    return ALGORITHMS.register(name if name is not None else getattr(cls, "name", ""), cls)


def register_stage_hook(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``hook`` usable as the stage hook ``name`` in this process (see :data:`STAGE_HOOKS`)."""
    return STAGE_HOOKS.register(name, hook)


def register_model(
    name: str,
    build: Callable[..., nn.Module],
    *,
    options: Mapping[str, Callable[[str, Any], Any]] | None = None,
    min_side: int = 1,
) -> ModelSpec:
    """Make ``build(input_shape, num_classes, **options)`` usable as model ``name`` in this
    process (see :class:`ModelSpec` for ``options`` and ``min_side``)."""
    return MODEL_SPECS.register(name, ModelSpec(build, dict(options or {}), min_side))


def register_dataset(
    name: str, load: Callable[..., Dataset], *, options: tuple[str, ...] = ()
) -> DatasetSpec:
    """Make ``load(name, root, download, **options) -> Dataset`` usable as dataset ``name`` in
    this process (see :class:`DatasetSpec`)."""
    return DATASET_SPECS.register(name, DatasetSpec(load, tuple(options)))


def import_modules(names: Any, key: str = "imports", *, from_cwd: bool = True) -> None:
    """Import each module of config key ``key`` (a list of module names), so that the plugins they
    register are known. The working directory is on the search path, as for ``python -m``, unless
    ``from_cwd`` is false: then it is taken off the path for these imports (``python -m`` puts it
    there), so a command reading someone else's directory never imports from where it was started."""
    if names is None:
        return
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"config key {key!r} must be a list of module names, got {names!r}")
    cwd = os.getcwd()
    saved = list(sys.path)
    if not from_cwd:
        sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    elif cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        _import_each(names, key)
    finally:
        if not from_cwd:
            sys.path[:] = saved


def _import_each(names: Sequence[str], key: str) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any failure of the user's module, in one line
            raise ConfigError(
                f"config key {key!r}: module {name!r} failed to import: {_first_line(err)}"
            ) from None
