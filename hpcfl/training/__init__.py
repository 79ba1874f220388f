"""Local training pieces shared by every algorithm: flat models, local SGD, evaluation."""

from hpcfl.training.evaluate import evaluate
from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import LocalResult, LocalSchedule, cross_entropy_loss, local_sgd

__all__ = ["FlatModel", "LocalResult", "LocalSchedule", "cross_entropy_loss", "evaluate", "local_sgd"]
