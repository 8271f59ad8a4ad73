"""Where optional features live: an entry ``"package.module:attribute"`` names the object a
run or command loads when it asks for that feature, so importing the core loads no wing."""

from __future__ import annotations

import importlib


def load(entry: str):
    """The object ``entry`` names, its module imported now (once; later calls find it)."""
    module, _, attribute = entry.partition(":")
    return getattr(importlib.import_module(module), attribute)
