"""facenet: FaceNet triplet training in PyTorch, with every graph freed after each step."""

__version__ = "0.1.0"
