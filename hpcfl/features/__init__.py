"""The Zarr store of eNTK features (TCT stage 2 input), written per client by the owning rank."""

from hpcfl.features.meta import DTYPES as DTYPES
from hpcfl.features.meta import FeatureMeta as FeatureMeta
from hpcfl.features.meta import model_hash as model_hash
from hpcfl.features.store import ClientWriter as ClientWriter
from hpcfl.features.store import FeatureStoreReader as FeatureStoreReader
from hpcfl.features.store import create_feature_store as create_feature_store
from hpcfl.features.store import mark_complete as mark_complete
from hpcfl.features.store import open_client_writer as open_client_writer
from hpcfl.features.store import open_feature_store as open_feature_store
from hpcfl.features.store import write_client as write_client

__all__ = [
    "DTYPES",
    "ClientWriter",
    "FeatureMeta",
    "FeatureStoreReader",
    "create_feature_store",
    "mark_complete",
    "model_hash",
    "open_client_writer",
    "open_feature_store",
    "write_client",
]
