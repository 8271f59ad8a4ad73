"""Image folders: walking ``root/<identity>/<image>`` trees, and :class:`IdentityFolder`.

Symbolic links are followed, but every real directory is visited once (remembered by
``(st_dev, st_ino)``, folders reached without a link first): a link back up (``up -> ..``) or to
a folder listed already is skipped, and so is a link to an image listed already, with one
warning naming them. ``IdentityFolder`` checks every image once and caches the result in a JSON
index keyed on the listing's names, modification times and sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from facenet.data.batches import DecodedCache
from facenet.data.images import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    CorruptImageError,
    inspect_image,
    read_image,
)
from facenet.errors import DataError, some_names
from facenet.files import read_json, write_text_atomic

INDEX_FILE_NAME = ".facenet_index.json"
INDEX_VERSION = 2  # 2: PNG checksums and the size limits checked; reasons recorded
_NAMES_IN_WARNING = 10
_HEADER_CHECK_THREADS = 8


def _key(path):
    """``(st_dev, st_ino)`` of what ``path`` names (links followed); None if it cannot be read."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _sorted_entries(folder):
    """The entries of ``folder`` not hidden, by name; none if it cannot be read (as os.walk)."""
    try:
        with os.scandir(folder) as entries:
            return sorted((e for e in entries if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError:
        return []


def _walk(root, max_depth=None):
    """``(folders, [(image path, stat), ...])`` under ``root``, folders down to ``max_depth``.

    Depth first in name order; links to folders are followed after every folder reached
    without one, and skipped when they lead to a folder seen or to one holding ``root``.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    real_root = Path(os.path.realpath(root))
    seen = {k for k in map(_key, (real_root, *real_root.parents)) if k is not None}
    stack, links, folders, skipped = [(root, 0)], [], [], []
    real, linked = [], []  # (path, stat) of image files, not links and links
    while stack or links:
        if stack:
            folder, depth = stack.pop()
        else:
            folder, depth = links.pop(0)
            if (key := _key(folder)) is None or key in seen:
                skipped.append(folder)
                continue
            seen.add(key)
        folders.append(folder)
        subfolders = []
        for entry in _sorted_entries(folder):
            path = Path(folder, entry.name)
            if entry.is_dir():
                if max_depth is not None and depth + 1 >= max_depth:
                    continue
                if entry.is_symlink():
                    links.append((path, depth + 1))
                elif (key := _key(path)) not in seen:  # else a bind mount of a folder seen
                    seen.add(key)
                    subfolders.append((path, depth + 1))
            elif entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS):
                (linked if entry.is_symlink() else real).append((path, entry.stat()))
        stack.extend(reversed(subfolders))  # depth first, in name order
    files_seen = {(s.st_dev, s.st_ino) for _, s in real}
    dropped = []
    for path, info in linked:  # a link to an image listed already (or through a link) is dropped
        key = (info.st_dev, info.st_ino)
        (dropped if key in files_seen else real).append((path, info))
        files_seen.add(key)
    _warn(
        root,
        _skipped_links(root, skipped, "folders already listed or holding it"),
        _skipped_links(root, [p for p, _ in dropped], "files already listed"),
    )
    return folders[1:], real  # root is the first


def _skipped_links(root, links, what):
    names = [p.relative_to(root).as_posix() for p in links]
    return f"skipped {_count(len(links), 'link', 'links')} to {what}", names


def list_images(root: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(paths, labels)`` of every image under ``root``, sorted; the label is the top-level
    folder's name ("" for an image directly in ``root``)."""
    root = Path(root)
    found = sorted(path for path, _ in _walk(root)[1])
    labels = [p.relative_to(root).parts[0] if p.parent != root else "" for p in found]
    return [str(p) for p in found], labels


def _identity_files(root):
    """``{identity: [(image name, mtime_ns, size), ...]}``, both levels sorted by name."""
    folders, files = _walk(root, max_depth=2)
    listing = {folder.name: [] for folder in sorted(folders)}
    for path, info in files:
        if path.parent != root:
            listing[path.parent.name].append((path.name, info.st_mtime_ns, info.st_size))
    return {identity: sorted(files) for identity, files in listing.items()}


def list_identities(root: str | os.PathLike) -> dict[str, list[str]]:
    """``{identity: [image file name, ...]}`` for every ``root/<identity>/`` folder, sorted
    (an identity without images too); images elsewhere are left out."""
    listing = _identity_files(Path(root))
    return {identity: [name for name, _, _ in files] for identity, files in listing.items()}


def _save_index(path, index):
    """Write the index atomically; a read-only location only costs a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(index))
    except OSError as err:  # write_text_atomic has removed its temporary file
        warnings.warn(
            f"cannot write the dataset index {path}: {err.strerror or err}; "
            "the folder will be checked again next time",
            stacklevel=3,
        )


def _splits_listing(index, listing) -> bool:
    """A saved index divides exactly the listed files into usable and corrupt ones (a hand-made
    or damaged one, whatever its signature, is rebuilt)."""
    listed = [(identity, name) for identity, files in listing.items() for name, _, _ in files]
    try:
        usable = [(i, n) for i, names in index["identities"].items() for n in names]
        corrupt = [(i, n) for i, n, reason in index["corrupt"] if isinstance(reason, str)]
        same_files = sorted(usable + corrupt) == sorted(listed)
        return index["identities"].keys() == listing.keys() and same_files
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def _build_index(root, listing, signature, limits):
    """Check every image short of decoding; split usable and corrupt files."""
    pairs = [(identity, name) for identity, files in listing.items() for name, _, _ in files]
    with ThreadPoolExecutor(max_workers=_HEADER_CHECK_THREADS) as pool:
        reasons = list(pool.map(lambda p: inspect_image(root / p[0] / p[1], *limits), pairs))
    identities = {identity: [] for identity in listing}
    corrupt = []
    for (identity, name), reason in zip(pairs, reasons):
        if reason is None:
            identities[identity].append(name)
        else:
            corrupt.append([identity, name, reason])
    return {
        "version": INDEX_VERSION,
        "root": str(root.resolve()),
        "signature": signature,
        "identities": identities,
        "corrupt": corrupt,
    }


def _count(n, singular, plural):
    return f"{n} {singular if n == 1 else plural}"


def _warn(root, *parts):
    """One warning of the ``(what, names)`` parts that have names, up to 10 names each."""
    text = "; ".join(
        f"{what}: {some_names(names, _NAMES_IN_WARNING)}" for what, names in parts if names
    )
    if text:
        warnings.warn(f"{root}: {text}", stacklevel=4)


class IdentityFolder(Dataset):
    """Face images in ``root/<identity>/<image>``, labelled by identity folder in name order.

    A file that fails :func:`~facenet.data.images.inspect_image` is left out with one warning
    (``on_corrupt="skip"``) or raises :class:`CorruptImageError` (``"error"``); one that passes
    but cannot be decoded raises when loaded. Identities without a usable image are ignored;
    those with fewer than ``min_images`` stay in ``samples`` but get ``triplet_labels`` -1,
    which samplers never draw. ``exclude`` names identities left out entirely (held out).
    ``cache_bytes`` keeps decoded images (after ``transform.prepare`` where the transform has
    one) in memory, over all loading processes; ``cache_dir`` holds the index instead of
    ``root``. Items are ``(transform(image), label)``, the image uint8 (3, H, W).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_corrupt: str = "skip",
        cache_dir: str | os.PathLike | None = None,
        min_images: int = 2,
        exclude: Collection[str] = (),
        limits: tuple[int, float] = (DEFAULT_MAX_PIXELS, DEFAULT_MAX_ASPECT_RATIO),
        cache_bytes: int = 0,
    ):
        if on_corrupt not in ("skip", "error"):
            raise ValueError(f"on_corrupt={on_corrupt!r}: expected 'skip' or 'error'")
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"dataset folder not found: {self.root}")
        self.transform = transform
        self.min_images = min_images
        self.limits = (int(limits[0]), float(limits[1]))
        self.decoded = DecodedCache(cache_bytes)
        index = self._load_or_build_index(cache_dir)
        self.skipped = self._apply_corrupt_policy(index["corrupt"], on_corrupt)
        excluded = set(exclude)
        kept = {k: v for k, v in index["identities"].items() if k not in excluded}
        self.classes = self._usable_identities(kept)
        self.class_to_idx = {name: label for label, name in enumerate(self.classes)}
        self.samples = [
            (str(self.root / identity / name), self.class_to_idx[identity])
            for identity in self.classes
            for name in index["identities"][identity]
        ]
        self.targets = [label for _, label in self.samples]
        self.triplet_labels = self._triplet_labels()  # (N,) int64

    def _load_or_build_index(self, cache_dir):
        listing = _identity_files(self.root)
        # A hash of the listing and the limits its files were checked against.
        signature = json.dumps([INDEX_VERSION, self.limits, listing]).encode()
        signature = hashlib.sha256(signature).hexdigest()
        index_path = self.root / INDEX_FILE_NAME
        if cache_dir is not None:
            key = hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:16]
            index_path = Path(cache_dir) / f"facenet_index_{key}.json"
        try:
            index = read_json(index_path)
        except DataError:
            index = None
        self.index_reused = (
            isinstance(index, dict)
            and index.get("signature") == signature
            and _splits_listing(index, listing)
        )
        if not self.index_reused:
            index = _build_index(self.root, listing, signature, self.limits)
            _save_index(index_path, index)
        return index

    def _apply_corrupt_policy(self, corrupt, on_corrupt):
        paths = [str(self.root / identity / name) for identity, name, _ in corrupt]
        if paths and on_corrupt == "error":
            more = f" ({len(paths) - 1} more corrupt files)" if len(paths) > 1 else ""
            raise CorruptImageError(paths[0], corrupt[0][2] + more)
        _warn(self.root, (f"skipped {len(paths)} corrupt or unreadable image(s)", paths))
        return paths

    def _usable_identities(self, identities):
        empty = [identity for identity, names in identities.items() if not names]
        folders = _count(len(empty), "identity folder", "identity folders")
        _warn(self.root, (f"ignored {folders} without usable images", empty))
        usable = sorted(identity for identity, names in identities.items() if names)
        if len(usable) < 2:
            raise DataError(
                f"{self.root}: found {len(usable)} identity folder(s) with usable images; "
                "need at least 2 (layout: root/<identity>/<image>)"
            )
        return usable

    def _triplet_labels(self):
        labels = np.asarray(self.targets, dtype=np.int64)  # (N,)
        too_few = np.bincount(labels, minlength=len(self.classes)) < self.min_images  # (C,)
        names = [self.classes[c] for c in np.flatnonzero(too_few)]
        many = f"{_count(len(names), 'identity', 'identities')} with fewer than"
        _warn(self.root, (f"{many} {self.min_images} images left out of triplet sampling", names))
        return np.where(too_few[labels], -1, labels)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        image = self.decoded.images.get(index)  # uint8 (3, H, W), or None
        if image is None:
            image = read_image(path, *self.limits)
            # The transform's deterministic part (TrainCrops.prepare) runs once per image.
            prepare = getattr(self.transform, "prepare", None)
            image = prepare(image) if prepare is not None else image
            self.decoded.put(index, image)
        if self.transform is not None:
            image = self.transform(image)
        return image, label
