"""Drift diversity per layer (FedPVR, Definition 1 / Eq. 2 and Figure 2).

ξ_l = Σ_i ‖m_i,l‖² / ‖Σ_i m_i,l‖² over the round's participants, m_i = x_i − x the client update
restricted to layer l. It is large when the clients move a layer in different directions.

No extra communication: the runner already sums the weighted models Σ w_i x_i (w_i = n_i), so
Σ w_i m_i = Σ w_i x_i − W x comes for free, and the only extra traffic is one summed vector of L
per-layer squared norms Σ w_i² ‖m_i,l‖² in the same allreduce. The ratio is taken over the
weighted updates w_i m_i; ξ is invariant to a common scale, so this is exactly Eq. 2 when the
participants hold equal sample counts, and its n_i-weighted form otherwise.
"""

from __future__ import annotations

import torch

from hpcfl.training.layout import StateLayout


class DriftDiversity:
    """Per-layer slices of the trainable state and the two halves of ξ."""

    def __init__(self, layout: StateLayout) -> None:
        self.layers = layout.modules  # modules owning trainable parameters, in vector order
        self._slices = [
            [(e.start, e.stop) for e in layout.params_of([m]) if e.module == m] for m in self.layers
        ]

    @property
    def size(self) -> int:
        return len(self.layers)

    def _per_layer(self, v: torch.Tensor) -> torch.Tensor:
        """Σ of squares of ``v`` over each layer's slices."""
        return torch.stack(
            [sum((v[a:b].to(torch.float64) ** 2).sum() for a, b in sl) for sl in self._slices]  # type: ignore[misc]
        )

    def squares(self, x_client: torch.Tensor, x_server: torch.Tensor) -> torch.Tensor:
        """‖m_i,l‖² of one participant, per layer; the round sums w_i² times these over participants
        (the drift slots of the round buffer, :class:`hpcfl.runner.observers.Drift`)."""
        return self._per_layer(x_client - x_server)

    def row(
        self, squares: torch.Tensor, weighted_sum: torch.Tensor, weight: float, x_server: torch.Tensor
    ) -> dict:
        """``{"drift_diversity": {layer: ξ}}`` from the summed slots and the round's Σ w_i x_i."""
        total = weighted_sum.to(torch.float64) - weight * x_server.to(torch.float64)  # Σ w_i m_i
        denom = self._per_layer(total)
        xi = squares.to(torch.float64) / denom.clamp_min(torch.finfo(torch.float64).tiny)
        return {"drift_diversity": {name: float(v) for name, v in zip(self.layers, xi, strict=True)}}
