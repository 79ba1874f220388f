"""The round loop: local work, one allreduce, the server step, evaluation, bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcfl.algorithms import ClientState, NonFiniteLoss, ServerState
from hpcfl.errors import DivergenceError
from hpcfl.runner.federation import Federation, client_generator
from hpcfl.training.evaluate import evaluate

# Called after every round with (round_done, server, clients, metrics_row or None); returns True to stop.
RoundHook = Callable[[int, ServerState, dict[int, ClientState], dict[str, Any] | None], bool]


@dataclass
class RoundTimes:
    """Where one round's wall time went, in seconds."""

    compute: float = 0.0
    allreduce: float = 0.0
    evaluate: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def run_rounds(
    fed: Federation,
    server: ServerState,
    clients: dict[int, ClientState],
    start: int,
    stop: int,
    *,
    stage: str = "train",
    hook: RoundHook | None = None,
) -> tuple[ServerState, dict[int, ClientState], int]:
    """Run rounds ``start`` .. ``stop - 1``; returns the final states and the rounds completed."""
    cfg, comm, algo = fed.cfg, fed.comm, fed.algorithm
    L = algo.payload_size()
    K = len(fed.parts)
    # [ sum_k w_k * payload_k | sum_k w_k | per-client non-finite flags | local loss sum ]
    buf = torch.zeros(L + 1 + K + 1, dtype=server.x.dtype, device=server.x.device)
    bytes_per_model = L * server.x.element_size()
    rnd = start
    for rnd in range(start, stop):
        t0 = time.perf_counter()
        # 1. local updates of this rank's clients, summed into one flat buffer
        buf.zero_()
        for k in fed.owned:
            try:
                upload, clients[k] = algo.client_update(
                    server, clients[k], fed.clients[k], fed.trainer, client_generator(cfg.seed, rnd, k)
                )
            except NonFiniteLoss:
                buf[L + 1 + k] = 1.0
                continue
            buf[:L].add_(upload.payload, alpha=upload.weight)
            buf[L] += upload.weight
            buf[-1] += upload.metrics.get("loss", 0.0)
        t1 = time.perf_counter()
        # 2. one allreduce per round
        comm.allreduce(buf)
        t2 = time.perf_counter()
        bad = torch.nonzero(buf[L + 1 : L + 1 + K]).flatten().tolist()
        if bad:
            raise DivergenceError(
                f"loss became NaN/inf in round {rnd + 1} on client {bad[0]}"
                f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; lower lr (now {cfg.lr})"
            )
        # 3. the same server update on every rank
        server = algo.server_update(server, buf[:L].clone(), float(buf[L]))
        done = rnd + 1
        # 4. evaluation, sharded over ranks
        row = None
        if done % cfg.eval_every == 0 or done == stop:
            fed.flat.load(server.x)
            acc, loss = evaluate(fed.flat.model, fed.dataset.test.x, fed.dataset.test.y, comm)
            t3 = time.perf_counter()
            row = {
                "round": done,
                "stage": stage,
                "test_accuracy": acc,
                "test_loss": loss,
                "local_loss": float(buf[-1]) / K,
            }
            if cfg.eval_train:
                row["train_accuracy"], row["train_loss"] = evaluate(
                    fed.flat.model, fed.dataset.train.x, fed.dataset.train.y, comm
                )
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
    return server, clients, stop if stop > start else start
