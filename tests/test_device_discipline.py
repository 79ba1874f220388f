"""The static half of the device check (issue 39): no tensor factory in ``hpcfl/`` runs without
``device=`` unless a ``# host: <why>`` marker says the host is meant (``tests/device_discipline.py``).
The dynamic half, a CUDA device played on the CPU, is ``tests/test_fake_accelerator.py``."""

from __future__ import annotations

import re

import pytest

from tests.device_discipline import REPO, offenders, package_offenders

#: offenders in code being moved to the run's device (issue 39 item 1: TCT stage 2 on the run's
#: device), by ``path: code`` so that edits above them do not move the key; empty once that lands
PENDING: frozenset[str] = frozenset()  # TCT stage 2 is on the run's device (branch tctdevice)


def _keys(found: tuple[str, ...]) -> set[str]:
    return {re.sub(r":\d+: ", ": ", line) for line in found}


def test_no_factory_without_device_outside_marked_host_work() -> None:
    found = package_offenders()
    new = sorted(line for line in found if re.sub(r":\d+: ", ": ", line) not in PENDING)
    assert new == [], (
        "tensor factories without device= (take the device from the data: *_like, new_*, "
        "device=x.device; or mark deliberate host work with '# host: <why>'):\n" + "\n".join(new)
    )


def test_nothing_is_pending() -> None:
    assert _keys(package_offenders()) == set()


def test_the_walker_sees_the_package() -> None:
    files = list((REPO / "hpcfl").rglob("*.py"))
    assert len(files) > 100
    marked = sum(f.read_text().count("# host:") for f in files)
    assert marked >= 40  # the markers this check asks for are there to be read


def test_the_reverted_loss_sum_line_is_caught() -> None:
    """``hpcfl/training/sgd.py:154`` before issue 39's fix: the loss sum made on the host."""
    reverted = (
        "import torch\n"
        "def local_sgd(flat, x, y):\n"
        "    loss_sum = torch.zeros((), dtype=torch.float64)\n"
        "    return loss_sum\n"
    )
    assert offenders(REPO / "sgd.py", reverted) == [(3, "torch.zeros((), dtype=torch.float64)")]


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("a = torch.zeros(3)", True),
        ("a = torch.randperm(5, generator=g)", True),
        ("a = torch.tensor([1, 2])", True),
        ("a = torch.as_tensor([1.0])", True),
        ("a = torch.as_tensor(t)", False),  # a tensor keeps its device
        ("a = torch.normal(mean, std)", False),
        ("a = torch.zeros(3, device=x.device)", False),
        ("a = torch.zeros(3, **opts)", False),  # device= may be in opts
        ("a = torch.zeros_like(x)", False),
        ("a = x.new_zeros(3)", False),
        ("a = torch.zeros(3)  # host: index bookkeeping", False),
        ("a = torch.zeros(3)  # host:", True),  # a marker needs a reason
        ("a = torch.zeros(3)  # on the host", True),
        ("# host: a seeded generator\na = torch.randn(3, generator=g)", False),
        ("a = foo(\n    torch.zeros(3),\n    1,\n)  # host: why", False),
        ("import torch as T\na = T.ones(2)", True),
        ("from torch import zeros\na = zeros(2)", True),
        ("def f():\n    return torch.arange(4)", True),
        ("for i in torch.arange(4):  # host: a loop index\n    pass", False),
        ("for i in range(3):  # host: not the call's line\n    a = torch.arange(4)", True),
    ],
)
def test_the_check_rules(source: str, flagged: bool) -> None:
    found = offenders(REPO / "x.py", "import torch\n" + source)
    assert bool(found) == flagged, found
