"""What a feature store was computed from: :class:`FeatureMeta` and the model hash."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from hpcfl.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""Feature dtypes a store can hold (bfloat16 is stored as its raw uint16 bits: zarr has no bf16)."""


def model_hash(model: nn.Module) -> str:
    """sha256 over ``model.state_dict()`` in its (fixed) order: each entry's name, dtype, shape, bytes.

    Buffers are included on purpose: BatchNorm running statistics change eval-mode features just
    as much as the parameters do.
    """
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        cpu = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{cpu.dtype}|{tuple(cpu.shape)}|".encode())
        h.update(cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b"")
    return h.hexdigest()


@dataclass(frozen=True)
class FeatureMeta:
    """The settings a feature store's rows were computed with (recorded in its root attributes)."""

    model_hash: str
    seed: int
    p: int
    logit: int
    params: str
    dtype: str
    coords_hash: str
    num_params: int
    # the classifier the features were taken through: "fresh1" (a fresh seeded 1-output head, the
    # default since issue 16), "keep" (the C-output head re-initialised, output ``logit``), or "-"
    # (last-layer features, which do not go through the head)
    head: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"feature dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        *,
        p: int,
        seed: int,
        logit: int = 0,
        params: str = "all",
        dtype: str = "float32",
        head: str = "fresh1",
    ) -> FeatureMeta:
        """The meta of features :func:`hpcfl.entk.entk_features` computes for these arguments
        (``model`` with the head ``head`` says it has: its hash and parameter count are taken as given)."""
        from hpcfl.entk import coordinate_set, coords_hash, num_params

        total = num_params(model, params)
        return cls(
            model_hash=model_hash(model),
            seed=int(seed),
            p=int(p),
            logit=int(logit),
            params=params,
            dtype=dtype,
            coords_hash=coords_hash(coordinate_set(total, int(p), int(seed))),
            num_params=total,
            head=head,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the features."""
        return DTYPES[self.dtype]

    def to_attrs(self) -> dict[str, Any]:
        """JSON-able form for zarr attributes."""
        return asdict(self)

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> FeatureMeta:
        """Inverse of :meth:`to_attrs` (unknown keys are ignored, missing ones raise KeyError).

        Stores written before ``head`` was recorded were taken through the kept C-output head (eNTK)
        or no head at all (last-layer features): they read back as ``"keep"`` or ``"-"``, so an
        old eNTK store never matches the default ``"fresh1"`` features and is recomputed.
        """
        attrs = dict(attrs)
        if "head" not in attrs and "params" in attrs:
            attrs["head"] = "-" if attrs["params"] == "last_layer" else "keep"
        return cls(**{f.name: attrs[f.name] for f in fields(cls)})

    def mismatches(self, other: FeatureMeta) -> list[str]:
        """Names of the fields that differ, each as ``field (store X, requested Y)``."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                show = (lambda v: str(v)[:12]) if f.name.endswith("hash") else str
                out.append(f"{f.name} (store {show(mine)}, requested {show(theirs)})")
        return out
