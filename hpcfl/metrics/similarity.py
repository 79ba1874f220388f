"""Per-layer CKA between every client's trained model and the global model (FedCKA, Figure 2).

Son, Kim & Chung ("Compare Where It Matters", Sec. 3.1 and Fig. 2) motivate FedCKA with the linear
CKA of each layer of each client's local model against the global model on the test set: early
layers stay similar across clients, late ones do not, even on IID data. ``cka_metrics: true``
records the same in a run's metrics rows, for any algorithm whose upload is the local model:

- the **probe** is a fixed subset of :data:`PROBE_SIZE` test samples (drawn once from the run's
  seed), the same for every round and client;
- the **layers** are all of the model's layers (:func:`hpcfl.metrics.layers.block_outputs`);
- in every round that writes a metrics row, the round's global model (the one the clients start
  from) runs the probe once and its centred Grams are kept; after each client's local update the
  client's model runs the probe and its per-layer CKA against them is written into the client's
  slots of the round's allreduced buffer, so the values of clients trained on other ranks arrive
  with the one allreduce the round already does (no extra communication);
- the row gets ``"cka": {layer: [CKA of client 0, client 1, ...]}``.

The computation uses the working model between client updates (each update loads its own start
state), in eval mode and without gradient, so it does not change the run's results.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hpcfl.errors import ConfigError
from hpcfl.metrics.gram import CentredGram, cka_from_grams
from hpcfl.metrics.layers import LayerTap, block_outputs
from hpcfl.training.flat import FlatModel

__all__ = ["PROBE_SIZE", "LayerSimilarity"]

PROBE_SIZE = 512
"""Test samples in the CKA probe (Grams are PROBE_SIZE² per layer; the paper uses the test set)."""


class LayerSimilarity:
    """Per-layer linear CKA of client models against a reference model on a fixed probe batch.

    Args:
        flat: the working model (states are loaded into it).
        probe: the probe inputs ``(P, ...)``, on the model's device.
        num_clients: K; client k's values sit in slots ``[k·S, (k+1)·S)`` of the round buffer.
        layers: module names (default: every layer of the model).
        chunk: batch size of the probe forwards.
    """

    def __init__(
        self,
        flat: FlatModel,
        probe: Tensor,
        num_clients: int,
        layers: list[str] | None = None,
        *,
        chunk: int = 256,
    ) -> None:
        self.flat = flat
        self.probe = probe
        self.num_clients = num_clients
        self.layers = layers or block_outputs(flat.model)
        self.chunk = chunk
        self._reference: list[CentredGram] | None = None

    @classmethod
    def on_test_probe(
        cls, flat: FlatModel, test_x: Tensor, num_clients: int, *, seed: int, device: torch.device
    ) -> LayerSimilarity:
        """The similarity of a run: its probe is a seeded sample of up to ``PROBE_SIZE`` of the test
        inputs ``test_x`` (at least 4), moved to ``device``, the model's."""
        if test_x.shape[0] < 4:
            raise ConfigError("cka_metrics needs a test set of at least 4 samples")
        gen = torch.Generator().manual_seed(seed)
        # host: a seeded probe index
        pick = torch.randperm(test_x.shape[0], generator=gen)[:PROBE_SIZE].sort().values
        return cls(flat, test_x[pick].to(device), num_clients)

    @property
    def size(self) -> int:
        """Buffer slots needed: one per (client, layer)."""
        return self.num_clients * len(self.layers)

    @torch.no_grad()
    def _grams(self, state: Tensor) -> list[CentredGram]:
        self.flat.load(state)
        model = self.flat.model
        model.eval()
        parts: list[list[Tensor]] = [[] for _ in self.layers]
        with LayerTap(model, self.layers) as tap:
            for start in range(0, self.probe.shape[0], self.chunk):
                _, acts = tap.forward(self.probe[start : start + self.chunk])
                for part, a in zip(parts, acts, strict=True):
                    part.append(a.flatten(1))  # (chunk, d)
        return [CentredGram(torch.cat(part)) for part in parts]

    def set_reference(self, state: Tensor) -> None:
        """Run the reference (global) model on the probe and keep its centred Grams."""
        self._reference = self._grams(state)

    def values(self, state: Tensor) -> Tensor:
        """Per-layer CKA of the model ``state`` against the reference, ``(L,)`` (a client's slot)."""
        if self._reference is None:
            raise RuntimeError("set_reference() must run before values()")
        grams = self._grams(state)
        return torch.stack([cka_from_grams(a, b) for a, b in zip(grams, self._reference, strict=True)])

    def row(self, values: Tensor) -> dict[str, Any]:
        """The metrics entry from the summed slots: ``{"cka": {layer: [value per client]}}``."""
        table = values[: self.size].reshape(self.num_clients, len(self.layers)).T.tolist()
        return {
            "cka": {
                name: [float(v) for v in per_client]
                for name, per_client in zip(self.layers, table, strict=True)
            }
        }
