"""A CUDA device played on the CPU: device mixes and host syncs of a ``device: cuda`` run, found
on a machine without a GPU.

``with fake_cuda() as dev:`` makes ``torch.cuda.is_available()`` true and runs every tensor on the
CPU while tracking, tensor by tensor, which ones a real run would hold on the GPU ("accel") and
which on the host ("host"). Code under test sees a GPU: ``t.device`` is ``cuda:0`` and ``t.is_cuda``
is true for accel tensors, ``torch.cuda.get_device_properties`` answers, and Triton dispatchers take
their torch reference (every loaded module's ``HAS_TRITON`` reads False while the mode is on).
Results are those of the CPU: on a path that does not branch on the device type they are bit for
bit the CPU run's.

What it catches (each raises ``RuntimeError("Expected all tensors to be on the same device, but
found at least two devices, cuda:0 and cpu! (fake accelerator: OP)")``, as PyTorch would on CUDA):

- an op that meets an accel tensor and a host tensor that is not 0-dim (a host 0-dim tensor may feed
  an accel op: PyTorch passes CPU scalars to kernels);
- an in-place op (``add_``, ``+=``, ``out=``) that writes into a host tensor from an accel one, 0-dim
  target included (``loss_sum += loss`` with ``loss_sum`` made on the host);
- indexing a host tensor with an accel index; assigning a ``.grad`` of the other device;
- a missing ``.to()``: data left on the host meets the model on the device; ``.numpy()`` of an accel
  tensor (``TypeError``, as on CUDA); a CPU generator drawing an accel tensor.

What it counts (``dev.syncs``: device-to-host reads that wait for the GPU; ``dev.copies``: host-to-
device copies), by kind, and by kind and ``file:line in function`` of the calling code in ``dev.sync_sites`` and
``dev.copy_sites``:
``item``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``tolist``, ``.cpu()``/``.to(cpu)``,
``copy_`` into the host, ``equal``/``allclose``, data-dependent shapes (``nonzero``, boolean masks,
``unique``, ...); copies: ``.to(cuda)``/``.cuda()`` of a host tensor, a host index or value used on
an accel tensor (a pageable copy, which PyTorch makes before the kernel).

How tensors are classed: factories (``torch.zeros``, ``torch.tensor``, ``torch.randperm``, ...) by
their ``device=`` (none or ``cpu``: host); ``*_like``/``new_*`` and every other op by their inputs
(accel if any input is accel, else host if any is host); ``.to``/``.cuda``/``.cpu``, ``Module.to``
and ``param.data = ...`` by their target. Tensors made in C++ where no Python call returns them
(autograd's gradients, the tensors ``vmap`` passes to the function it maps) are unknown: they are
looked through to the tensor they wrap, or adopted when they first meet a classed tensor;
``vmap``'s results take the class of its inputs.

What it cannot see: ops inside C++ and inside Python functions that torch dispatches as one call
(the body of ``F.cross_entropy``, ``backward`` and the hooks it runs) are checked only at that
call's inputs and outputs; work handed to a ``ThreadPoolExecutor`` inside the block runs under the
mode (torch keeps its mode stack per thread), other threads do not; tensors made before the mode is entered are unknown (neutral), so make
the data inside it; ``torch.Generator(device="cuda")`` is a CPU generator that says
``cuda`` (its draws are the CPU stream's, not CUDA's Philox: a path drawing on the device matches a
real GPU run in where tensors live, not in values); timings, memory and the ordering of CUDA streams
are not modelled, and ``torch.save`` writes accel tensors as the CPU tensors they are (``torch.load``
with a ``cuda`` ``map_location`` loads them as accel tensors).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ACCEL = "accel"
HOST = "host"

#: tensor factories: the device comes from ``device=`` (absent: the host)
FACTORIES = frozenset(
    {
        "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "range",
        "linspace", "logspace", "eye", "tensor", "as_tensor", "asarray", "empty_strided",
        "scalar_tensor", "from_numpy", "frombuffer", "tril_indices", "triu_indices",
        "sparse_coo_tensor", "bartlett_window", "blackman_window",
        "hamming_window", "hann_window", "kaiser_window",
    }
)  # fmt: skip
#: factories that copy their input's device when given a tensor and no ``device=``
_FROM_DATA = frozenset({"as_tensor", "asarray"})
#: ``torch.normal``, ``torch.poisson`` ... are ops over tensors; ``torch.normal(mean, std, size)`` of
#: floats is a factory: a call with no tensor argument is treated as one
_FACTORY_IF_NO_TENSOR = frozenset({"normal"})
#: device-inheriting factories: the device of their input unless ``device=`` is given
LIKE = frozenset(
    {
        "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
        "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
        "new_empty_strided",
    }
)  # fmt: skip
#: methods that read an accel tensor's value on the host (the host waits for the device)
READS = frozenset(
    {
        "item", "__bool__", "__float__", "__int__", "__index__", "__complex__", "tolist",
        "__format__", "__repr__", "__str__", "__contains__", "equal", "allclose", "is_nonzero",
    }
)  # fmt: skip
#: ops whose output shape depends on an accel tensor's values (the host must wait to allocate)
SHAPE_READS = frozenset(
    {
        "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
        "repeat_interleave",
    }
)  # fmt: skip
_NUMPY = frozenset({"numpy", "__array__"})
_INPLACE_DUNDERS = frozenset(
    {
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
        "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    }
)  # fmt: skip
#: in-place by name but not writing into their first argument's values
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad_", "share_memory_", "set_grad_enabled_"})
_HERE = str(Path(__file__).resolve())
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _mix_error(op: str) -> RuntimeError:
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
        f"cpu! (fake accelerator: {op})"
    )


class _Classes:
    """Tensor object → ACCEL | HOST, held weakly (keyed by ``id``: tensors compare elementwise, so
    a ``WeakKeyDictionary`` would call ``Tensor.__eq__``)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, str]] = {}

    def get(self, t: torch.Tensor) -> str | None:
        entry = self._by_id.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def set(self, t: torch.Tensor, cls: str) -> None:
        key, table = id(t), self._by_id

        def drop(ref: weakref.ref, key: int = key, table: dict = table) -> None:
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), cls)


def _is_accel_device(device: Any) -> bool | None:
    """True for a CUDA device spec, False for the CPU, None for no device."""
    if device is None:
        return None
    if isinstance(device, int):
        return True  # an ordinal names a CUDA device
    return torch.device(device).type == "cuda"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _op_name(func: Callable) -> tuple[str, str]:
    """(name, kind) of what the mode was called for: kind "get"/"set" for a tensor attribute's
    getter/setter (name = the attribute), else "call"."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and type(owner).__name__ == "getset_descriptor":
        return owner.__name__, "get" if name == "__get__" else "set"
    return name, "call"


def _caller() -> str:
    """``file:line in function`` of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-2]):
        if frame.filename != _HERE and not frame.filename.startswith(_TORCH_DIR):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "?"


@dataclass
class FakeDeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers under :func:`fake_cuda`."""

    name: str = "fake accelerator (CPU)"
    total_memory: int = 16 * 2**30
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132


class FakeCuda(TorchFunctionMode):
    """The mode behind :func:`fake_cuda` (see the module docstring). Read ``syncs``, ``copies`` (by
    kind) and ``sync_sites``, ``copy_sites`` (by kind and calling ``file:line in function``); ``reset()`` clears
    them."""

    def __init__(self, index: int = 0, total_memory: int = 16 * 2**30) -> None:
        super().__init__()
        self.device = torch.device("cuda", index)
        self.properties = FakeDeviceProperties(total_memory=total_memory)
        self.classes = _Classes()
        self.syncs: Counter[str] = Counter()
        self.copies: Counter[str] = Counter()
        self.sync_sites: Counter[tuple[str, str]] = Counter()
        self.copy_sites: Counter[tuple[str, str]] = Counter()

    # -- public -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the sync and copy counters."""
        self.syncs.clear()
        self.copies.clear()
        self.sync_sites.clear()
        self.copy_sites.clear()

    def is_accel(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is held on the (fake) device."""
        return self._class(t) == ACCEL

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is held on the host."""
        return self._class(t) == HOST

    # -- bookkeeping ------------------------------------------------------------------------------
    def _class(self, t: torch.Tensor) -> str | None:
        cls = self.classes.get(t)
        if cls is None and torch._C._functorch.is_functorch_wrapped_tensor(t):
            inner = torch._C._functorch.get_unwrapped(t)
            cls = self._class(inner)
            if cls is not None:
                self.classes.set(t, cls)
        return cls

    def _mark(self, out: Any, cls: str | None, *, force: bool = False) -> Any:
        if cls is not None:
            for t in _tensors(out):
                if force or self._class(t) is None:
                    self.classes.set(t, cls)
        return out

    def _sync(self, kind: str) -> None:
        self.syncs[kind] += 1
        self.sync_sites[(kind, _caller())] += 1

    def _copy(self, kind: str) -> None:
        self.copies[kind] += 1
        self.copy_sites[(kind, _caller())] += 1

    # -- the mode ---------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: C901 - one rule per case
        kwargs = dict(kwargs or {})
        name, kind = _op_name(func)
        if kind == "get":
            return self._get(func, name, args, kwargs)
        if kind == "set":
            return self._set(func, name, args, kwargs)
        if name in FACTORIES and not (name in _FROM_DATA and _tensors(args[:1])):
            return self._factory(func, name, args, kwargs)
        if name in _FACTORY_IF_NO_TENSOR and not _tensors((args, kwargs)):
            return self._factory(func, name, args, kwargs)
        if name in LIKE and kwargs.get("device") is not None:
            return self._factory(func, name, args, kwargs)
        if name in ("to", "cuda", "cpu"):
            return self._to(func, name, args, kwargs)
        if name == "pin_memory":  # the CPU build cannot pin: a host copy stands for the pinned one
            return self._mark(args[0].clone(), HOST)
        if name == "is_pinned":
            return False
        if name == "get_device":
            return self.device.index if self._class(args[0]) == ACCEL else func(*args, **kwargs)

        tensors = _tensors((args, kwargs))
        classes = [self._class(t) for t in tensors]
        accel = ACCEL in classes
        if name in _NUMPY and accel and self._class(args[0]) == ACCEL:
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                "to host memory first. (fake accelerator)"
            )
        if name in READS and accel:
            self._sync(name)
            return func(*args, **kwargs)
        if name in ("__getitem__", "__setitem__"):
            return self._index(func, name, args, kwargs)
        if name == "copy_":
            return self._copy_(func, args, kwargs)
        if name in SHAPE_READS and accel:
            self._sync(name)
        out_target = kwargs.get("out")
        inplace = (
            name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES
        ) or name in _INPLACE_DUNDERS
        targets = _tensors(out_target) if out_target is not None else (tensors[:1] if inplace else [])
        if targets:
            self._check_write(name, targets, [t for t in tensors if all(t is not x for x in targets)])
        elif accel:
            self._check_mix(name, tensors, classes)
        if accel and "generator" in kwargs and kwargs["generator"] is not None:
            self._check_generator(kwargs["generator"])
        out = func(*args, **kwargs)
        cls = ACCEL if accel else (HOST if HOST in classes else None)
        if cls is not None:
            for t, c in zip(tensors, classes, strict=True):
                if c is None:  # an unknown input (made in C++) is adopted by what it meets
                    self.classes.set(t, cls)
        return self._mark(out, cls)

    # -- the rules --------------------------------------------------------------------------------
    def _check_mix(self, name: str, tensors: list[torch.Tensor], classes: list[str | None]) -> None:
        for t, c in zip(tensors, classes, strict=True):
            if c == HOST and t.dim() > 0:
                raise _mix_error(name)

    def _check_write(self, name: str, targets: list[torch.Tensor], others: list[torch.Tensor]) -> None:
        target_classes = {self._class(t) for t in targets}
        other_classes = [self._class(t) for t in others]
        if HOST in target_classes and ACCEL in other_classes:
            raise _mix_error(name)  # a write into a host tensor from the device, 0-dim or not
        if ACCEL in target_classes:
            self._check_mix(name, others, other_classes)
        elif ACCEL in other_classes:
            self._check_mix(name, others, other_classes)
            self._mark(targets, ACCEL)  # an unknown target written from the device lives there

    def _check_generator(self, generator: torch.Generator) -> None:
        if generator.device.type == "cpu":
            raise RuntimeError(
                "Expected a 'cuda' device type for generator but found 'cpu' (fake accelerator)"
            )

    def _get(self, func, name: str, args, kwargs):
        t = args[0]
        if self._class(t) == ACCEL:
            if name == "device":
                return self.device
            if name == "is_cuda":
                return True
            if name == "is_cpu":
                return False
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # .grad, .data, .T, ...: the owner's device
            self._mark(out, self._class(t))
        return out

    def _set(self, func, name: str, args, kwargs):
        t, value = args[0], args[1]
        if isinstance(value, torch.Tensor):
            own, new = self._class(t), self._class(value)
            if name == "data" and new is not None:
                self.classes.set(t, new)  # Module.to(cuda) moves parameters by param.data = moved
            elif name == "grad" and {own, new} == {ACCEL, HOST}:
                raise RuntimeError(
                    "assigned grad has data located on a different device (fake accelerator: .grad)"
                )
        return func(*args, **kwargs)

    def _factory(self, func, name: str, args, kwargs):
        device = kwargs.get("device")
        on_accel = _is_accel_device(device)
        if on_accel:
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            if kwargs.get("generator") is not None:
                self._check_generator(kwargs["generator"])
        out = func(*args, **kwargs)
        if on_accel is None and name in LIKE | {"normal"}:
            srcs = [self._class(t) for t in _tensors(args)]
            return self._mark(out, ACCEL if ACCEL in srcs else (HOST if HOST in srcs else None), force=True)
        return self._mark(out, ACCEL if on_accel else HOST, force=True)

    def _to(self, func, name: str, args, kwargs):
        t = args[0]
        src = self._class(t)
        if name == "cuda":
            target, rest = ACCEL, {"non_blocking": kwargs.get("non_blocking", False)}
        elif name == "cpu":
            target, rest = HOST, {}
        else:
            others = _tensors((args[1:], kwargs))
            if others:  # t.to(other): other's device and dtype
                target = self._class(others[0]) or src
                rest = {"dtype": others[0].dtype}
            else:
                device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
                on_accel = _is_accel_device(device)
                target = src if on_accel is None else (ACCEL if on_accel else HOST)
                rest = {"dtype": dtype, "non_blocking": non_blocking, "memory_format": memory_format}
                rest = {k: v for k, v in rest.items() if v is not None}
            rest["copy"] = bool(kwargs.get("copy", False))
        crossing = src is not None and target is not None and src != target
        if crossing:
            if src == ACCEL:
                self._sync("cpu" if name == "cpu" else "to(cpu)")
            else:
                self._copy("cuda" if name == "cuda" else "to(cuda)")
        if name in ("cuda", "cpu"):
            out = t.clone() if crossing else t
        else:
            if crossing:
                rest["copy"] = True
            out = torch.Tensor.to(t, **rest)
        if out is t:
            if src is None and target is not None:
                self.classes.set(t, target)
            return out
        return self._mark(out, target or src, force=True)

    def _index(self, func, name: str, args, kwargs):
        t = args[0]
        own = self._class(t)
        index = _tensors(args[1])
        value = _tensors(args[2:3]) if name == "__setitem__" else []
        if own == HOST:
            if any(self._class(i) == ACCEL for i in index):
                raise _mix_error(name)
            if any(self._class(v) == ACCEL for v in value):
                if index:  # index_put_ wants its values where its target is
                    raise _mix_error(name)
                self._sync("setitem")  # a slice assignment is a copy to the host
        elif own == ACCEL:
            for i in index:
                c = self._class(i)
                if c == HOST:
                    self._copy("index")
                elif c == ACCEL and i.dtype == torch.bool:
                    self._sync("mask")
            if any(self._class(v) == HOST and v.dim() > 0 for v in value):
                self._copy("setitem")
        out = func(*args, **kwargs)
        if name == "__getitem__":
            return self._mark(out, own or next((self._class(i) for i in index if self._class(i)), None))
        return out

    def _copy_(self, func, args, kwargs):
        dst, src = args[0], args[1]
        a, b = self._class(dst), self._class(src)
        if a == HOST and b == ACCEL:
            self._sync("copy_")
        elif a == ACCEL and b == HOST and src.dim() > 0:
            self._copy("copy_")
        elif a is None and b is not None:
            self.classes.set(dst, b)
        return func(*args, **kwargs)


def _patched_cuda(mode: FakeCuda, device_count: int = 1) -> dict[str, Any]:
    props = mode.properties
    return {
        "is_available": lambda: True,
        "device_count": lambda: device_count,
        "current_device": lambda: mode.device.index,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_device_properties": lambda device=None: props,
        "get_device_name": lambda device=None: props.name,
        "get_device_capability": lambda device=None: (props.major, props.minor),
        "mem_get_info": lambda device=None: (props.total_memory * 7 // 8, props.total_memory),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "is_bf16_supported": lambda *a, **k: True,
    }


class _FakeGenerator(torch.Generator):
    """Stands for ``torch.Generator`` under :func:`fake_cuda`: a ``cuda`` generator is a CPU one
    whose ``device`` says ``cuda`` (draws from it into accel tensors pass the generator check)."""

    def __new__(cls, device: Any = "cpu") -> _FakeGenerator:
        self = super().__new__(cls, device="cpu")
        self._fake_device = torch.device("cuda", 0) if _is_accel_device(device) else torch.device("cpu")
        return self

    def __init__(self, device: Any = "cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._fake_device


@contextlib.contextmanager
def fake_cuda(index: int = 0, total_memory: int = 16 * 2**30, device_count: int = 1) -> Iterator[FakeCuda]:
    """Play ``cuda:INDEX`` on the CPU for the block (module docstring); yields the mode, whose
    ``syncs``/``copies`` count the host syncs and host-to-device copies made inside the block.
    ``device_count``: how many GPUs ``torch.cuda.device_count()`` reports (a node's GPUs, of which
    this process plays one)."""
    mode = FakeCuda(index, total_memory)
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, value: Any) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    for attr, value in _patched_cuda(mode, device_count).items():
        patch(torch.cuda, attr, value)
    for module in list(sys.modules.values()):  # Triton kernels cannot run on the fake device
        if getattr(module, "HAS_TRITON", None) is True:
            patch(module, "HAS_TRITON", False)
    real_load = torch.load

    def load(*args: Any, map_location: Any = None, **kwargs: Any) -> Any:
        to_accel = not callable(map_location) and not isinstance(map_location, dict)
        if to_accel and _is_accel_device(map_location):
            return mode._mark(real_load(*args, map_location="cpu", **kwargs), ACCEL, force=True)
        return real_load(*args, map_location=map_location, **kwargs)

    patch(torch, "load", load)
    patch(torch, "Generator", _FakeGenerator)
    real_vmap_impl = torch._functorch.apis.vmap_impl

    def vmap_impl(func: Callable, in_dims: Any, out_dims: Any, randomness: Any, chunk_size: Any, *args, **kw):
        classes = {mode._class(t) for t in _tensors((args, kw))}
        out = real_vmap_impl(func, in_dims, out_dims, randomness, chunk_size, *args, **kw)
        return mode._mark(out, ACCEL if ACCEL in classes else (HOST if HOST in classes else None))

    patch(torch._functorch.apis, "vmap_impl", vmap_impl)
    real_submit = concurrent.futures.ThreadPoolExecutor.submit

    def submit(pool: concurrent.futures.ThreadPoolExecutor, fn: Callable, /, *args: Any, **kw: Any) -> Any:
        def in_mode(*a: Any, **k: Any) -> Any:  # torch's mode stack is per thread: push it in the worker
            with mode:
                return fn(*a, **k)

        return real_submit(pool, in_mode, *args, **kw)

    patch(concurrent.futures.ThreadPoolExecutor, "submit", submit)
    try:
        with mode:
            yield mode
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
