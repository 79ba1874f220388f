"""Flower's side of the peers harness: the bundle's FedAvg experiment through Flower's simulation engine.

    .peers/flower/bin/python benchmarks/peers/run_flower.py --seed 0 --mode 1actor --out bench-out/peers/f.json

Written as Flower 1.42's docs show a user (the quickstart-pytorch app on the Message API):
a ``ClientApp`` whose ``@app.train()`` loads the global ``ArrayRecord`` into the model, trains one
local epoch and replies with its arrays and ``num-examples``; a ``ServerApp`` whose ``@app.main()``
starts a ``FedAvg`` strategy with a centralized ``evaluate_fn`` (the full test set, every 5 rounds
and after the last); ``flwr.simulation.run_simulation`` with 100 SuperNodes on the Ray backend.

The same clients each round: Flower samples nodes at random inside ``FedAvg.configure_train``
(``random.sample`` of the connected node ids) and the node ids of a simulation are not the
partition ids. A user chooses them the documented way, with a custom strategy: one ``query``
message to every node at start-up maps node id → ``partition-id`` (its ``node_config``), and
``configure_train`` is overridden to send the round's messages to the nodes of ``draws.json``.
FedAvg's own ``aggregate_train`` averages weighted by ``num-examples`` (sample weighting).

``--algorithm fedadam | fedyogi | fedadagrad | fedavgm`` (issue 60, item 5) runs Flower's own
strategy of that name (``flwr.serverapp.strategy.FedAdam`` etc.) at its defaults (only
``fraction_train`` and ``fraction_evaluate`` are set, as for FedAvg), with the same drawn clients:
the selection above is a subclass over the chosen strategy whose ``configure_train`` calls the
strategy's own (its bookkeeping: FedOpt keeps the arrays it sends, FedAvgM its first ones) and
sends its message to the draw's nodes instead of the strategy's random sample. The strategy's
defaults are read off the instance and checked against the parameters hpcfl is given
(``server_opt_check.CASES``): a Flower whose defaults moved fails the run, naming them.

Modes (``backend_config["client_resources"]``; Ray sizes its actor pool as CPUs / num_cpus):
``1actor``: one Ray actor with both cores (the fastest single-worker mode: the ClientApps run
one at a time, each with 2 torch threads); ``ray2``: 2 Ray actors of 1 CPU each, two clients in
parallel. ``run_simulation`` has no in-process backend: the ServerApp runs in this process and
every ClientApp in a Ray actor process.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import peer_common as pc  # noqa: E402  (first: the script's start time)

MODES = {
    "1actor": "run_simulation, 1 Ray actor x 2 CPUs",
    "ray2": "run_simulation, 2 Ray actors x 1 CPU",
}
CLIENT_CPUS = {"1actor": 2, "ray2": 1}
ALGORITHMS = ("fedavg", "fedadam", "fedyogi", "fedadagrad", "fedavgm")
#: algorithm -> (Flower's strategy class in flwr.serverapp.strategy, its server_opt_check.CASES key)
STRATEGIES = {
    "fedavg": ("FedAvg", None),
    "fedadam": ("FedAdam", "fedadam"),
    "fedyogi": ("FedYogi", "fedyogi"),
    "fedadagrad": ("FedAdagrad", "fedadagrad"),
    "fedavgm": ("FedAvgM", "fedavgm_default"),
}

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network here: no usage events
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

_EXP_CACHE: dict[str, pc.Experiment] = {}  # per Ray actor process: the bundle, memory-mapped once


def _experiment(directory: str) -> pc.Experiment:
    if directory not in _EXP_CACHE:
        _EXP_CACHE[directory] = pc.load_experiment(directory, mmap=True)
    return _EXP_CACHE[directory]


def build_client_app() -> Any:
    """The ClientApp: local training on the node's partition, as Flower's quickstart writes it."""
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(content=RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = msg.content["config"]
        exp = _experiment(str(cfg["experiment"]))
        pid = int(context.node_config["partition-id"])
        x, y = exp.client_data(pid)
        model = pc.SimpleCNN(exp.input_shape, exp.num_classes)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        gen = pc.client_generator(int(cfg["seed"]), int(cfg["server-round"]) - 1, pid)
        loss, _ = pc.train_one_epoch(model, x, y, int(cfg["batch-size"]), float(cfg["lr"]), gen)
        metrics = {
            "train_loss": loss,
            "num-examples": int(x.shape[0]),
            "torch-threads": torch.get_num_threads(),
        }
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    return app


def flower_params(strategy: Any, name: str) -> dict[str, float]:
    """The hyper-parameters of ``strategy``, an instance of Flower's server-optimiser strategy
    ``name`` (or a subclass), in hpcfl's keys (server_opt_check.CASES)."""
    if name == "FedAvgM":
        return {"server_lr": strategy.server_learning_rate, "beta": strategy.server_momentum}
    out = {"server_lr": strategy.eta, "beta1": strategy.beta_1, "beta2": strategy.beta_2, "tau": strategy.tau}
    if name == "FedAdagrad":
        del out["beta2"]  # Flower's FedAdagrad sums Δ² (β2 unused); so does hpcfl's
    return out


def drawn_strategy(
    exp: pc.Experiment, seed: int, rec: pc.Recorder, threads: set[int], algorithm: str = "fedavg"
) -> Any:
    """Flower's strategy for ``algorithm`` at its defaults, its training round sent to the nodes of
    the bundle's draw (see the module docstring)."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.serverapp import Grid
    from flwr.serverapp import strategy as strategies

    base = getattr(strategies, STRATEGIES[algorithm][0])

    class Drawn(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            # fraction_evaluate=0: no federated evaluation; the global model is evaluated centrally
            super().__init__(
                fraction_train=exp.spec["clients_per_round"] / exp.num_clients, fraction_evaluate=0.0
            )
            self.node_of: dict[int, int] = {}

        def map_nodes(self, grid: Grid) -> None:
            """partition-id → node id, from one query message to every node (once all have
            connected: Flower's own sampling waits for them the same way)."""
            while len(nodes := list(grid.get_node_ids())) < exp.num_clients:
                time.sleep(0.1)
            msgs = [
                Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes
            ]
            replies = list(grid.send_and_receive(msgs))
            errors = [r.error.reason for r in replies if r.has_error()]
            if errors:
                raise RuntimeError(f"{len(errors)} nodes failed the query: {errors[0]}")
            for reply in replies:
                pid = int(reply.content["metrics"]["partition-id"])
                self.node_of[pid] = reply.metadata.src_node_id
            if len(self.node_of) != exp.num_clients:
                raise RuntimeError(
                    f"{len(self.node_of)} of {exp.num_clients} nodes answered the query ({len(replies)} replies)"
                )

        def configure_train(self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid) -> Any:
            rec.round_start()
            # the strategy's own configure_train (its bookkeeping, "server-round" in the config);
            # its message goes to the draw's nodes, not to its random sample
            sampled = list(super().configure_train(server_round, arrays, config, grid))
            if not sampled:
                raise RuntimeError(f"round {server_round}: {base.__name__}.configure_train sent nothing")
            record = sampled[0].content
            nodes = [self.node_of[k] for k in exp.draw(seed, server_round)]
            return [Message(content=record, message_type=MessageType.TRAIN, dst_node_id=n) for n in nodes]

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            errors = [r.error.reason for r in replies if r.has_error()]
            if errors:
                raise RuntimeError(f"round {server_round}: {len(errors)} ClientApps failed: {errors[0]}")
            out = super().aggregate_train(server_round, replies)
            samples = sum(int(r.content["metrics"]["num-examples"]) for r in replies)
            threads.update(int(r.content["metrics"]["torch-threads"]) for r in replies)
            rec.trained(samples)
            return out

    Drawn.__name__ = Drawn.__qualname__ = f"Drawn{base.__name__}"
    strategy = Drawn()
    case = STRATEGIES[algorithm][1]
    if case is not None:
        from server_opt_check import CASES

        ours, hpcfls = flower_params(strategy, base.__name__), CASES[case][3]
        if ours != hpcfls:
            raise RuntimeError(
                f"Flower's {base.__name__} defaults {ours} differ from hpcfl's params {hpcfls}"
            )
    return strategy


def build_server_app(
    args: Any, exp: pc.Experiment, rec: pc.Recorder, threads: set[int], box: dict[str, Any]
) -> Any:
    """The ServerApp: the strategy from hpcfl's initial model, centralized evaluation on the test set."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()
    evaluated = pc.eval_rounds(args.rounds, int(exp.spec["eval_every"]))

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            return None  # Flower calls it before round 1 too; the experiment does not evaluate there
        result = None
        if server_round in evaluated:
            model = pc.SimpleCNN(exp.input_shape, exp.num_classes)
            model.load_state_dict(arrays.to_torch_state_dict())
            acc, loss = pc.evaluate(model, exp.test_x, exp.test_y)
            rec.evaluated(server_round, acc, loss)
            result = MetricRecord({"accuracy": acc, "loss": loss})
        rec.round_end()
        return result

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            strategy = drawn_strategy(exp, args.seed, rec, threads, args.algorithm)
            if args.algorithm != "fedavg":
                box["server_params"] = flower_params(strategy, STRATEGIES[args.algorithm][0])
            strategy.map_nodes(grid)
            config = ConfigRecord(
                {
                    "lr": float(exp.spec["lr"]),
                    "batch-size": int(exp.spec["batch_size"]),
                    "seed": args.seed,
                    "experiment": str(Path(args.experiment).resolve()),
                }
            )
            strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(pc.initial_model(args.seed, exp).state_dict()),
                num_rounds=args.rounds,
                train_config=config,
                evaluate_fn=global_evaluate,
            )
        except BaseException as err:  # run_simulation logs and swallows the ServerApp's errors
            box["error"] = err
            raise

    return app


def run(args: Any, exp: pc.Experiment, rec: pc.Recorder, info: dict[str, Any]) -> None:
    from importlib.metadata import version

    import flwr  # noqa: F401  (the import is part of startup_s)
    from flwr.simulation import run_simulation

    info["version"] = version("flwr")
    threads: set[int] = set()
    box: dict[str, Any] = {}
    backend = {"client_resources": {"num_cpus": CLIENT_CPUS[args.mode], "num_gpus": 0.0}}
    run_simulation(
        server_app=build_server_app(args, exp, rec, threads, box),
        client_app=build_client_app(),
        num_supernodes=exp.num_clients,
        backend_config=backend,
    )
    if "error" in box:
        raise box["error"]
    info["server_params"] = box.get("server_params")
    info["notes"] = (
        f"ray {version('ray')}; ClientApps in Ray actors (torch threads {sorted(threads)}), ServerApp in the "
        "driver; the round's clients chosen by a custom configure_train (Flower samples nodes at random); "
        "node ids mapped to partition ids by one query message per node at start-up; run_simulation is "
        "deprecated in 1.42 in favour of `flwr run`"
    )
    if args.algorithm != "fedavg":
        name = STRATEGIES[args.algorithm][0]
        info["notes"] += f"; {name} at Flower's defaults {info['server_params']}" + (
            "" if name == "FedAvgM" else " (v starts at 0; eta_l is stored, never sent to a client)"
        )


if __name__ == "__main__":
    sys.exit(pc.main(MODES, run, "flower", algorithms=ALGORITHMS))
