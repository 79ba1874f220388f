"""Datasets and their federated partitions.

``load_dataset(name, data_root)`` returns normalised in-memory tensors read from the official files
(checksum-verified, downloaded on demand); ``partition(labels, spec, num_clients, ...)`` splits a
train set over clients (``iid``, ``dir:ALPHA``, ``classes:C`` — NIID-Bench's #C rule —,
``balanced-classes:C``, ``natural``), reproducibly from a seed, and the helpers beside
it save, reload, tabulate and plot the result.

The names load on first use (:mod:`hpcfl._lazy`): ``hpcfl.data.root`` is read by every command,
and must not import torch.
"""

from hpcfl._lazy import lazy_exports

lazy_exports(
    __name__,
    {
        "hpcfl.data.partition": [
            "PARTITION_KINDS",
            "SavedPartition",
            "format_partition_table",
            "load_partition",
            "parse_partition_spec",
            "partition",
            "partition_stats",
            "plot_partition_heatmap",
            "save_partition",
        ],
        "hpcfl.data.registry": [
            "DATASETS",
            "NORMALIZATION",
            "canonical_name",
            "clear_dataset_cache",
            "load_dataset",
        ],
        "hpcfl.data.root": ["resolve_data_root"],
        "hpcfl.data.synthetic": ["make_synthetic"],
        "hpcfl.data.types": ["Dataset", "Split"],
    },
)

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
