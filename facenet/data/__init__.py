"""Face data: image folders, P x K sampling, seed-style triplet lists, built-in synthetic faces.

``pairs`` (LFW-format pair lists) is imported as ``facenet.data.pairs``.
"""

from facenet.data.folder import IdentityFolder
from facenet.data.images import CorruptImageError, build_transform, looks_like_image, read_image
from facenet.data.loading import make_loader, measure_throughput, seed_worker
from facenet.data.samplers import PKSampler
from facenet.data.synthetic import SyntheticIdentities, prepare_synthetic_data
from facenet.data.triplets import TripletListDataset, generate_triplets

__all__ = [
    "CorruptImageError",
    "IdentityFolder",
    "PKSampler",
    "SyntheticIdentities",
    "TripletListDataset",
    "build_transform",
    "generate_triplets",
    "looks_like_image",
    "make_loader",
    "measure_throughput",
    "prepare_synthetic_data",
    "read_image",
    "seed_worker",
]
