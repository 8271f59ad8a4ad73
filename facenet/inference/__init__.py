"""After training: load a trained model in one call, embed a folder, match probes against a
gallery, export (ONNX, ``torch.export``) with a parity check, and align photographs (MTCNN,
imported only when aligning).
"""

from facenet.inference.embed import FolderEmbeddings, embed_folder
from facenet.inference.export import export_model
from facenet.inference.identify import Gallery, identification_rates, match
from facenet.inference.loading import TrainedModel, load_model, save_weights

__all__ = [
    "FolderEmbeddings",
    "Gallery",
    "TrainedModel",
    "embed_folder",
    "export_model",
    "identification_rates",
    "load_model",
    "match",
    "save_weights",
]
