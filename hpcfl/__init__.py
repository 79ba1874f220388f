"""hpcfl: federated learning on heterogeneous data, from a laptop to a SLURM cluster.

The public surface is re-exported here; everything else is internal and may move. A run is a
:class:`Config` (from YAML with :func:`load_config`, or :func:`config_from_dict`) passed to
:func:`run_experiment`; the building blocks it uses (datasets, partitions, models, algorithms,
communicators) are exported for scripts that assemble their own experiments.

The names load on first use (:mod:`hpcfl._lazy`, PEP 562): ``import hpcfl`` imports neither torch
nor zarr, so the commands that only read files (``hpcfl status``, ``hpcfl report``) stay light.
"""

from typing import TYPE_CHECKING

from hpcfl._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the same names load lazily
    from hpcfl.algorithms import ALGORITHMS as ALGORITHMS
    from hpcfl.algorithms import Algorithm as Algorithm
    from hpcfl.comm import Communicator as Communicator
    from hpcfl.comm import LocalComm as LocalComm
    from hpcfl.comm import get_comm as get_comm
    from hpcfl.config import Config as Config
    from hpcfl.config import config_from_dict as config_from_dict
    from hpcfl.config import load_config as load_config
    from hpcfl.data import Dataset as Dataset
    from hpcfl.data import load_dataset as load_dataset
    from hpcfl.data import partition as partition
    from hpcfl.data import partition_stats as partition_stats
    from hpcfl.errors import HpcflError as HpcflError
    from hpcfl.models import MODELS as MODELS
    from hpcfl.models import build_model as build_model
    from hpcfl.registry import register_algorithm as register_algorithm
    from hpcfl.registry import register_dataset as register_dataset
    from hpcfl.registry import register_model as register_model
    from hpcfl.runner import RunResult as RunResult
    from hpcfl.runner import StopRequest as StopRequest
    from hpcfl.runner import run_experiment as run_experiment

lazy_exports(
    __name__,
    {
        "hpcfl.algorithms": ["ALGORITHMS", "Algorithm"],
        "hpcfl.comm": ["Communicator", "LocalComm", "get_comm"],
        "hpcfl.config": ["Config", "config_from_dict", "load_config"],
        "hpcfl.data": ["Dataset", "load_dataset", "partition", "partition_stats"],
        "hpcfl.errors": ["HpcflError"],
        "hpcfl.models": ["MODELS", "build_model"],
        "hpcfl.registry": ["register_algorithm", "register_dataset", "register_model"],
        "hpcfl.runner": ["RunResult", "StopRequest", "run_experiment"],
    },
)

__version__ = "0.1.0"
__all__ = [
    "ALGORITHMS",
    "MODELS",
    "Algorithm",
    "Communicator",
    "Config",
    "Dataset",
    "HpcflError",
    "LocalComm",
    "RunResult",
    "StopRequest",
    "__version__",
    "build_model",
    "config_from_dict",
    "get_comm",
    "load_config",
    "load_dataset",
    "partition",
    "partition_stats",
    "register_algorithm",
    "register_dataset",
    "register_model",
    "run_experiment",
]
