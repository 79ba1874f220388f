"""Local training pieces shared by every algorithm: flat models, local SGD, evaluation."""

from hpcfl.training.batched import ClientJob, LinearCorrection, batched_local_sgd
from hpcfl.training.evaluate import evaluate
from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import LocalResult, LocalSchedule, LocalSteps, cross_entropy_loss

__all__ = [
    "ClientJob",
    "FlatModel",
    "LinearCorrection",
    "LocalResult",
    "LocalSchedule",
    "LocalSteps",
    "batched_local_sgd",
    "cross_entropy_loss",
    "evaluate",
]
