"""Face data: image folders, P x K sampling, seed-style triplet lists, decoding.

``pairs`` (LFW-format pair lists) is imported as ``facenet.data.pairs``; the demo's synthetic
faces are a wing (``facenet.wings.demo.synthetic``).
"""

from facenet.data.folder import IdentityFolder
from facenet.data.images import CorruptImageError, build_transform, looks_like_image, read_image
from facenet.data.loading import make_loader, measure_throughput, seed_worker
from facenet.data.samplers import PKSampler
from facenet.data.triplets import TripletListDataset, generate_triplets

__all__ = [
    "CorruptImageError",
    "IdentityFolder",
    "PKSampler",
    "TripletListDataset",
    "build_transform",
    "generate_triplets",
    "looks_like_image",
    "make_loader",
    "measure_throughput",
    "read_image",
    "seed_worker",
]
