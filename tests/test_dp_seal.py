"""The private path sealed where it can be checked (issue 61 item 4).

Under sample-level DP a participant that uploads a model other than the one it received while it
took fewer DP-SGD steps than its schedule trained some other way: each plugin below does FedAvg's
local work outside the private path, one way the probe found (``torch.optim`` on the trainer's
model, a fresh :class:`Trainer`, the base ``Trainer.steps`` called on the DP trainer, ``local_sgd``,
:class:`LocalSteps`, part of the schedule privately and the rest not, the server step training on
data kept by ``client_update``). Each is refused in one line naming the client (or round) and the
rule, where before its final model was bit-identical to the non-private run while ``hpcfl report``
said "sample-level DP, ε=0.00". Evaluation-time fine-tuning under DP is refused; personal models
under DP are labelled non-private.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import hpcfl
from hpcfl.algorithms import FedAvg
from hpcfl.algorithms.base import Trainer, model_upload, read_phases
from hpcfl.cli.main import main
from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from hpcfl.registry import ALGORITHMS
from hpcfl.runner import run_experiment
from hpcfl.training.sgd import LocalSteps, descend, read_result
from tests.helpers import local_sgd, write_config
from tests.test_dp_contract import Personal, _config

pytest.importorskip("opacus")


class _Outside(FedAvg):
    """FedAvg whose local training :meth:`train` does outside the private path."""

    dp_levels = ("client", "sample")

    def local_task(self, server, client, data, ctx):
        return None

    def client_update(self, server, client, data, ctx):
        flat = ctx.trainer.flat
        flat.load(server.x)
        result = self.train(flat, data, ctx)
        return model_upload(flat.vector.clone(), data, result), client

    def train(self, flat, data, ctx):
        raise NotImplementedError


class TorchOptim(_Outside):
    name = "seal_torch_optim"

    def train(self, flat, data, ctx):
        opt = torch.optim.SGD(flat.model.parameters(), lr=ctx.trainer.schedule.lr)
        for _ in range(ctx.trainer.schedule.num_steps(data.n)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(flat.model(data.x), data.y).backward()
            opt.step()
        return None


class FreshTrainer(_Outside):
    name = "seal_fresh_trainer"

    def train(self, flat, data, ctx):
        y, run = Trainer(flat, ctx.trainer.schedule).train_tallies(flat.vector.clone(), data, ctx.generator)
        flat.load(y)
        return read_phases(data, run)


class BaseSteps(_Outside):
    name = "seal_base_steps"

    def train(self, flat, data, ctx):
        return read_result(*descend(flat, Trainer.steps(ctx.trainer, data, ctx.generator)))


class PlainLocalSgd(_Outside):
    name = "seal_local_sgd"

    def train(self, flat, data, ctx):
        return local_sgd(flat, data.x, data.y, ctx.trainer.schedule, ctx.generator)


class OwnLocalSteps(_Outside):
    name = "seal_local_steps"

    def train(self, flat, data, ctx):
        steps = LocalSteps(flat, data.x, data.y, ctx.trainer.schedule, ctx.generator, ctx.trainer.loss_fn)
        return read_result(*descend(flat, steps))


class PartlyPrivate(_Outside):
    """One DP-SGD step through the trainer, the rest of the schedule with ``local_sgd``."""

    name = "seal_partly_private"

    def train(self, flat, data, ctx):
        import dataclasses

        one = dataclasses.replace(ctx.trainer.schedule, steps=1)
        y, _ = ctx.trainer.train_tallies(flat.vector.clone(), data, ctx.generator, schedule=one)
        flat.load(y)
        return local_sgd(flat, data.x, data.y, ctx.trainer.schedule, ctx.generator)


class ServerTrains(FedAvg):
    """Uploads the model it received, untrained, and keeps the data; the server step trains on it."""

    name = "seal_server_trains"
    dp_levels = ("client", "sample")
    kept: list = []

    def local_task(self, server, client, data, ctx):
        return None

    def client_update(self, server, client, data, ctx):
        ServerTrains.kept.append((data, ctx.trainer))
        return model_upload(server.x.clone(), data), client

    def server_update(self, server, aggregate, ctx):
        new, metrics = super().server_update(server, aggregate, ctx)
        for data, trainer in ServerTrains.kept:
            trainer.flat.load(new.x)
            local_sgd(trainer.flat, data.x, data.y, trainer.schedule, torch.Generator().manual_seed(0))
            new = type(new)(**{**new.__dict__, "x": trainer.flat.vector.clone()})
        ServerTrains.kept.clear()
        return new, metrics


OUTSIDE = (TorchOptim, FreshTrainer, BaseSteps, PlainLocalSgd, OwnLocalSteps, PartlyPrivate)


@pytest.fixture(scope="module", autouse=True)
def _plugins():
    for cls in (*OUTSIDE, ServerTrains):
        hpcfl.register_algorithm(cls)
    yield
    for cls in (*OUTSIDE, ServerTrains):
        ALGORITHMS._registered.pop(cls.name, None)
        ALGORITHMS._loaded.pop(cls.name, None)


@pytest.mark.parametrize("plugin", OUTSIDE, ids=lambda c: c.name)
def test_training_outside_the_private_path_is_refused_naming_the_client_and_the_rule(
    tmp_path, plugin
) -> None:
    """Without privacy each plugin trains (its model moves); under sample-level DP its first
    participant is refused in one line, before any row."""
    plain = run_experiment(
        config_from_dict({**_config("sample", plugin.name), "privacy": {}}), tmp_path / "p"
    )
    assert plain.finished and plain.metrics[1]["test_loss"] != plain.metrics[0]["test_loss"]
    with pytest.raises(ConfigError) as err:
        run_experiment(config_from_dict(_config("sample", plugin.name)), tmp_path / "dp")
    line = str(err.value)
    taken = 1 if plugin is PartlyPrivate else 0
    assert "\n" not in line and line.startswith(
        f"privacy.level=sample: algorithm {plugin.name!r}, client "
    ), line
    assert f"round 1: its upload differs from the model it received, but it took {taken} of its " in line
    assert "under sample-level DP a participant trains only through ctx.trainer" in line
    assert not (tmp_path / "dp" / "metrics.jsonl").read_text()


def test_a_server_step_that_trains_while_no_private_step_was_taken_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        run_experiment(config_from_dict(_config("sample", ServerTrains.name)), tmp_path / "dp")
    assert str(err.value) == (
        f"privacy.level=sample: algorithm {ServerTrains.name!r}, round 1: the server step changed the model "
        "although no participant has taken a DP-SGD step yet; under sample-level DP only the participants' "
        "DP-SGD steps may train (docs/privacy.md: what sample-level DP checks)"
    )


def test_the_refusal_is_one_line_from_the_command(tmp_path: Path, capsys) -> None:
    """``hpcfl run`` with a plugin (``imports:``) that trains with torch.optim under sample-level DP."""
    (tmp_path / "outside_plugin.py").write_text(
        textwrap.dedent(
            """
            import torch
            import hpcfl
            from hpcfl.algorithms import FedAvg
            from hpcfl.algorithms.base import model_upload

            @hpcfl.register_algorithm
            class OptimOutside(FedAvg):
                name = "optim_outside"
                dp_levels = ("client", "sample")

                def local_task(self, server, client, data, ctx):
                    return None

                def client_update(self, server, client, data, ctx):
                    flat = ctx.trainer.flat
                    flat.load(server.x)
                    opt = torch.optim.SGD(flat.model.parameters(), lr=0.05)
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(flat.model(data.x), data.y).backward()
                    opt.step()
                    return model_upload(flat.vector.clone(), data), client
            """
        )
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        cfg = write_config(
            tmp_path / "c.yaml", **_config("sample", "optim_outside", imports=["outside_plugin"])
        )
        code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r")])
    finally:
        sys.path.remove(str(tmp_path))
        ALGORITHMS._registered.pop("optim_outside", None)
        ALGORITHMS._loaded.pop("optim_outside", None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hpcfl: error: privacy.level=sample: algorithm 'optim_outside', client ")
    assert "took 0 of its" in lines[0]


@pytest.mark.parametrize("level", ["sample", "client"])
def test_finetune_eval_under_dp_is_refused_in_one_line(tmp_path, level) -> None:
    cfg = _config(level, "fedavg", client_eval=0.25, finetune_eval={"steps": 2, "lr": 0.05})
    with pytest.raises(ConfigError) as err:
        config_from_dict(cfg)
    assert str(err.value) == (
        f"privacy.level={level} with finetune_eval (steps 2): the evaluation-time fine-tuning trains on each "
        "client's data outside the accountant, so its accuracies would not be covered by the reported ε; set "
        "finetune_eval.steps: 0 (or run without privacy)"
    )
    config_from_dict({**cfg, "finetune_eval": {"steps": 0}})  # accepted without the fine-tuning


def test_personal_figures_under_dp_are_labelled_non_private_in_the_rows_and_the_report(tmp_path) -> None:
    from hpcfl.report import write_report

    hpcfl.register_algorithm(Personal)
    try:
        result = run_experiment(
            config_from_dict(_config("client", Personal.name, client_eval=0.25)), tmp_path / "r"
        )
    finally:
        ALGORITHMS._registered.pop(Personal.name, None)
        ALGORITHMS._loaded.pop(Personal.name, None)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["personal_private"] is False and "personal_acc_mean" in r for r in rows)
    assert result.metrics[-1]["personal_private"] is False
    write_report([tmp_path / "r"], tmp_path / "rep")
    text = (tmp_path / "rep" / "report.md").read_text()
    mean = 100 * rows[-1]["personal_acc_mean"]
    assert f"{mean:.2f}% (non-private)" in text and "outside the accountant" in text


def test_epsilon_is_never_printed_as_zero_for_a_positive_value() -> None:
    from hpcfl.report.summary import epsilon_text

    assert epsilon_text(3.0) == "ε=3.00" and epsilon_text(0.0012) == "ε=0.0012"
    assert epsilon_text(0.0049) == "ε=0.0049" and epsilon_text(0.005) == "ε=0.01"
    assert epsilon_text(0.0) == "ε=0 (no private step taken)"
