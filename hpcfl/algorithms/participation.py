"""Who trains in a round: everyone, or a sample of the population drawn from the round's generator.

The generator the runner passes is a pure function of (seed, round), so the participants are the
same on any number of ranks and after any resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class Population:
    """Every client of the run: its sample count (index = client id)."""

    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class Participation:
    """``count`` clients per round (None: all), uniformly without replacement or size-weighted.

    ``weighting='size'`` draws without replacement with probability proportional to n_k.
    """

    count: int | None = None
    weighting: str = "uniform"  # uniform | size

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise ConfigError(f"config key 'clients_per_round' must be >= 1, got {self.count}")
        if self.weighting not in ("uniform", "size"):
            raise ConfigError(
                f"config key 'participation_weighting' must be uniform or size, got {self.weighting!r}"
            )

    def full(self, population: Population) -> bool:
        """True when every client takes part in every round."""
        return self.count is None or self.count >= population.size

    def sample(self, population: Population, generator: torch.Generator) -> list[int]:
        """The round's participants, sorted by id."""
        K = population.size
        if self.full(population):
            return list(range(K))
        assert self.count is not None
        if self.weighting == "size":
            w = torch.tensor(population.sizes, dtype=torch.float64)  # host: sampling weights
            pick = torch.multinomial(w, self.count, replacement=False, generator=generator)
        else:
            pick = torch.randperm(K, generator=generator)[: self.count]  # host: seeded client ids
        return sorted(int(k) for k in pick)
