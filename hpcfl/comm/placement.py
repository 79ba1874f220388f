"""Which rank trains which clients."""

from __future__ import annotations

from collections.abc import Sequence

from hpcfl.errors import CommError


def place_clients(sizes: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Assign clients to ranks so that per-rank sample counts are balanced.

    Longest-processing-time greedy: clients by decreasing size go to the currently lightest rank
    (ties to the lowest rank), so the result depends only on ``sizes`` and ``num_ranks`` and every
    rank computes the same placement without talking. Each rank's list is sorted by client id.
    """
    if num_ranks > len(sizes):
        raise CommError(
            f"{num_ranks} ranks but only {len(sizes)} clients: every rank needs at least one client; "
            f"launch with at most {len(sizes)} ranks or raise num_clients"
        )
    load = [0] * num_ranks
    owned: list[list[int]] = [[] for _ in range(num_ranks)]
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(num_ranks), key=lambda r: (load[r], len(owned[r]), r))
        owned[r].append(k)
        load[r] += sizes[k]
    return [sorted(ks) for ks in owned]


def place_round(ids: Sequence[int], sizes: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Place one round's participants ``ids`` (with sample counts ``sizes``) on ranks.

    The same greedy as :func:`place_clients`, but a rank may stay idle when there are fewer
    participants than ranks. Every rank computes the same answer without talking.
    """
    load = [0] * num_ranks
    owned: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(ids)), key=lambda i: (-sizes[i], ids[i])):
        r = min(range(num_ranks), key=lambda r: (load[r], len(owned[r]), r))
        owned[r].append(ids[i])
        load[r] += sizes[i]
    return [sorted(ks) for ks in owned]
