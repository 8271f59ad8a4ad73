"""Embedding networks: ``embedding.EmbeddingNet`` (a backbone, an L2-normalised embedding head
and an optional classifier), the backbones by name (``backbones``; the tiny CNN in ``tiny``) and
initial weights from local files (``weights``). Import from the submodules: a name has one home.
"""
