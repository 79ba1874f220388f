"""The round loop: local work, one allreduce, the server step, evaluation, bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hpcfl.algorithms import Algorithm, ClientData, ClientState, NonFiniteLoss, ServerState, Trainer
from hpcfl.comm.base import Communicator
from hpcfl.errors import DivergenceError
from hpcfl.metrics.similarity import LayerSimilarity

# Called after every round with (round_done, server, clients, metrics_row or None); returns True to stop.
RoundHook = Callable[[int, ServerState, dict[int, ClientState], dict[str, Any] | None], bool]
# Evaluates the server state; returns metric columns (test_accuracy, test_loss, ...).
Evaluator = Callable[[ServerState], dict[str, float]]
# The RNG of client k in round r (a pure function of seed, round and client).
GeneratorFn = Callable[[int, int], torch.Generator]


@dataclass
class RoundPlan:
    """What the loop needs besides the states: who trains, on what, and how results are judged."""

    algorithm: Algorithm
    comm: Communicator
    data: Mapping[int, ClientData]  # this rank's clients
    trainer: Trainer | None
    num_clients: int
    generator: GeneratorFn
    evaluate: Evaluator
    eval_every: int = 1
    lr_hint: str = ""  # how to name the learning rate in a divergence message
    similarity: LayerSimilarity | None = None  # per-layer CKA of each client vs global (cka_metrics)


def run_rounds(
    plan: RoundPlan,
    server: ServerState,
    clients: dict[int, ClientState],
    start: int,
    stop: int,
    *,
    stage: str = "train",
    round_offset: int = 0,
    hook: RoundHook | None = None,
) -> tuple[ServerState, dict[int, ClientState], int]:
    """Run rounds ``start`` .. ``stop - 1``; returns the final states and the rounds completed.

    ``round_offset`` shifts the round numbers written to metrics (TCT's stage 2 continues stage 1's
    count).
    """
    algo, comm = plan.algorithm, plan.comm
    L = algo.payload_size()
    K = plan.num_clients
    S = plan.similarity.size if plan.similarity is not None else 0
    # [ sum_k w_k * payload_k | sum_k w_k | per-client non-finite flags | per-client CKA | local loss sum ]
    buf = torch.zeros(L + 1 + K + S + 1, dtype=server.x.dtype, device=server.x.device)
    sims = buf[L + 1 + K : L + 1 + K + S]
    bytes_per_model = L * server.x.element_size()
    done = start
    for rnd in range(start, stop):
        t0 = time.perf_counter()
        # 1. local updates of this rank's clients, summed into one flat buffer
        buf.zero_()
        probe = plan.similarity if (rnd + 1) % plan.eval_every == 0 or rnd + 1 == stop else None
        if probe is not None:
            probe.set_reference(server.x)
        for k, data in plan.data.items():
            try:
                upload, clients[k] = algo.client_update(
                    server, clients[k], data, plan.trainer, plan.generator(rnd, k)
                )
            except NonFiniteLoss:
                buf[L + 1 + k] = 1.0
                continue
            buf[:L].add_(upload.payload, alpha=upload.weight)
            buf[L] += upload.weight
            buf[-1] += upload.metrics.get("loss", 0.0)
            if probe is not None:
                probe.record(k, upload.payload, sims)
        t1 = time.perf_counter()
        # 2. one allreduce per round
        comm.allreduce(buf)
        t2 = time.perf_counter()
        bad = torch.nonzero(buf[L + 1 : L + 1 + K]).flatten().tolist()
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise DivergenceError(
                f"loss became NaN/inf in round {round_offset + rnd + 1} on client {bad[0]}{more}; "
                f"lower the learning rate{plan.lr_hint}"
            )
        # 3. the same server update on every rank
        server = algo.server_update(server, buf[:L].clone(), float(buf[L]))
        done = rnd + 1
        # 4. evaluation, sharded over ranks
        row = None
        if done % plan.eval_every == 0 or done == stop:
            row = {"round": round_offset + done, "stage": stage, **plan.evaluate(server)}
            row["local_loss"] = float(buf[-1]) / K
            if probe is not None:
                row.update(probe.row(sims))
            t3 = time.perf_counter()
            row.update(
                bytes_up=K * bytes_per_model,
                bytes_down=K * bytes_per_model,
                seconds=t3 - t0,
                compute_s=t1 - t0,
                allreduce_s=t2 - t1,
                eval_s=t3 - t2,
            )
        # 5. bookkeeping (metrics, checkpoint, progress) lives in the hook
        if hook is not None and hook(done, server, clients, row):
            return server, clients, done
    return server, clients, done
