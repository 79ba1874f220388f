"""Datasets and their federated partitions.

``load_dataset(name, data_root)`` returns normalised in-memory tensors read from the official files
(checksum-verified, downloaded on demand); ``partition(labels, spec, num_clients, ...)`` splits a
train set over clients (``iid``, ``dir:ALPHA``, ``classes:C`` — NIID-Bench's #C rule —,
``balanced-classes:C``, ``natural``), reproducibly from a seed, and the helpers beside
it save, reload, tabulate and plot the result.
"""

from hpcfl.data.partition import PARTITION_KINDS as PARTITION_KINDS
from hpcfl.data.partition import SavedPartition as SavedPartition
from hpcfl.data.partition import format_partition_table as format_partition_table
from hpcfl.data.partition import load_partition as load_partition
from hpcfl.data.partition import parse_partition_spec as parse_partition_spec
from hpcfl.data.partition import partition as partition
from hpcfl.data.partition import partition_stats as partition_stats
from hpcfl.data.partition import plot_partition_heatmap as plot_partition_heatmap
from hpcfl.data.partition import save_partition as save_partition
from hpcfl.data.registry import DATASETS as DATASETS
from hpcfl.data.registry import NORMALIZATION as NORMALIZATION
from hpcfl.data.registry import canonical_name as canonical_name
from hpcfl.data.registry import clear_dataset_cache as clear_dataset_cache
from hpcfl.data.registry import load_dataset as load_dataset
from hpcfl.data.root import resolve_data_root as resolve_data_root
from hpcfl.data.synthetic import make_synthetic as make_synthetic
from hpcfl.data.types import Dataset as Dataset
from hpcfl.data.types import Split as Split

__all__ = [
    "DATASETS",
    "NORMALIZATION",
    "PARTITION_KINDS",
    "Dataset",
    "SavedPartition",
    "Split",
    "canonical_name",
    "clear_dataset_cache",
    "format_partition_table",
    "load_dataset",
    "load_partition",
    "make_synthetic",
    "parse_partition_spec",
    "partition",
    "partition_stats",
    "plot_partition_heatmap",
    "resolve_data_root",
    "save_partition",
]
