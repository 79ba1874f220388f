"""hpcfl: federated learning on heterogeneous data, from a laptop to a SLURM cluster."""

from hpcfl.errors import HpcflError as HpcflError

__version__ = "0.1.0"
__all__ = ["HpcflError", "__version__"]
