"""Face data: image folders, P x K sampling, decoding.

``pairs`` (LFW-format pair lists) and ``triplets`` (seed-style triplet lists) are imported
from their modules; the demo's synthetic faces are a wing (``facenet.wings.demo.synthetic``).
"""

from facenet.data.folder import IdentityFolder
from facenet.data.images import CorruptImageError, build_transform, looks_like_image, read_image
from facenet.data.loading import make_loader, measure_throughput, seed_worker
from facenet.data.samplers import PKSampler

__all__ = [
    "CorruptImageError",
    "IdentityFolder",
    "PKSampler",
    "build_transform",
    "looks_like_image",
    "make_loader",
    "measure_throughput",
    "read_image",
    "seed_worker",
]
