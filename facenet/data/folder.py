"""A face dataset laid out as ``root/<identity>/<image>`` (VGGFace2, CASIA-WebFace, LFW crops).

Listing a large folder and checking every image takes a while, so the index (identities, their
usable images and the corrupt files found) is built once and cached in a JSON file, keyed on the
folder's listing signature (names, modification times and sizes). Any change to the folder
changes the signature and the index is rebuilt.

Symbolic links are followed (a dataset made of links into a shared store works), but every
real directory is visited once, remembered by ``(st_dev, st_ino)``: a link back to a folder
already listed (``up -> ..``) or to a folder holding the root is skipped, so a walk neither
loops nor lists a folder twice. Directories reached without a link are listed under their own
path, links afterwards; a link to a file already listed is skipped too. What was skipped is
named in one warning.
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
from facenet.errors import DataError
from facenet.files import write_text_atomic

__all__ = [
    "IdentityFolder",
    "INDEX_FILE_NAME",
    "list_identities",
    "list_images",
    "listing_signature",
]

INDEX_FILE_NAME = ".facenet_index.json"
INDEX_VERSION = 2  # 2: PNG checksums and the size limits checked; reasons recorded
# How many names a warning lists before it says "and N more".
_NAMES_IN_WARNING = 10
_HEADER_CHECK_THREADS = 8

# {identity: [(file name, mtime_ns, size), ...]}, both levels sorted by name.
Listing = dict[str, list[tuple[str, int, int]]]


def _is_image_name(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _key(path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``path`` names (links followed); None if it cannot be read."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _enclosing_keys(root: Path) -> set:
    """The keys of ``root`` and every folder above it: a link to one of them is a loop."""
    real = Path(os.path.realpath(root))
    return {k for k in (_key(p) for p in (real, *real.parents)) if k is not None}


def _sorted_entries(folder) -> list[os.DirEntry]:
    """The entries of ``folder`` not hidden, by name; none if it cannot be read (as os.walk)."""
    try:
        with os.scandir(folder) as entries:
            return sorted((e for e in entries if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError:
        return []


def _drop_linked_duplicates(real: list, linked: list) -> tuple[list, list]:
    """Files reached through a link to a file, less those listed already.

    Args:
        real: ``(item, key)`` of the files that are not links.
        linked: ``(item, key)`` of the links to files, in walk order.

    Returns:
        ``(kept, dropped)`` items of ``linked``: a link is dropped when its file is among
        ``real`` or was kept through an earlier link.
    """
    seen = {key for _, key in real}
    kept, dropped = [], []
    for item, key in linked:
        (dropped if key in seen else kept).append(item)
        seen.add(key)
    return kept, dropped


def _warn_skipped(root, links: list, files: list) -> None:
    """One warning naming the links a walk did not follow."""
    parts = []
    if links:
        parts.append(
            f"skipped {_count(len(links), 'link', 'links')} to folders already listed or "
            "holding it: " + _names_for_warning([_relative(p, root) for p in links])
        )
    if files:
        parts.append(
            f"skipped {_count(len(files), 'link', 'links')} to files already listed: "
            + _names_for_warning([_relative(p, root) for p in files])
        )
    if parts:
        warnings.warn(f"{root}: " + "; ".join(parts), stacklevel=3)


def _relative(path, root) -> str:
    """``path`` relative to ``root`` where it lies under it (as walked), else as given."""
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _walk_once(root: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """Image files under ``root``, every real directory visited once.

    Folders are taken depth first in name order, links to folders after every folder reached
    without one (so a folder is listed under its own path when it has one).

    Returns:
        ``(files, skipped_folder_links, skipped_file_links)``.
    """
    seen, enclosing = set(), _enclosing_keys(root)
    seen.add(_key(root))
    stack, links, skipped = [root], [], []
    real_files, linked_files = [], []
    while stack or links:
        if not stack:  # follow the next link to a folder, unless it leads somewhere seen
            link = links.pop(0)
            key = _key(link)
            if key is None or key in seen or key in enclosing:
                skipped.append(link)
                continue
            seen.add(key)
            stack.append(link)
        folder = stack.pop()
        subfolders = []
        for entry in _sorted_entries(folder):
            path = Path(folder, entry.name)
            if entry.is_symlink() and entry.is_dir():
                links.append(path)
            elif entry.is_dir(follow_symlinks=False):
                key = _key(path)
                if key not in seen:  # a bind mount of a folder seen already
                    seen.add(key)
                    subfolders.append(path)
            elif entry.is_file() and _is_image_name(entry.name):
                files = linked_files if entry.is_symlink() else real_files
                files.append((path, _key(path)))
        stack.extend(reversed(subfolders))  # depth first, in name order
    kept, dropped = _drop_linked_duplicates(real_files, linked_files)
    return [p for p, _ in real_files] + kept, skipped, dropped


def _identity_folders(root: Path) -> tuple[list[str], list[str]]:
    """The identity folders of ``root`` by name, and the links skipped: a link to a folder
    listed already (a real identity folder preferred) or to a folder holding ``root``."""
    entries = [e for e in _sorted_entries(root) if e.is_dir()]
    seen, enclosing = set(), _enclosing_keys(root)
    identities, skipped = [], []
    for entry in sorted(entries, key=lambda e: (e.is_symlink(), e.name)):
        key = _key(root / entry.name)
        if key is None or key in seen or key in enclosing:
            skipped.append(entry.name)
            continue
        seen.add(key)
        identities.append(entry.name)
    return sorted(identities), skipped


def list_identities(root: Path) -> Listing:
    """Every identity folder under ``root`` and the image files in it, with mtimes and sizes.

    Links are followed, but a folder or an image is listed once: a link to an identity folder
    listed already, to a folder holding ``root`` or to an image listed already is skipped,
    with one warning naming them.

    Args:
        root: the dataset folder; hidden entries and plain files at its top level are ignored.
    """
    identities, skipped = _identity_folders(root)
    real, linked = [], []
    for identity in identities:
        for entry in _sorted_entries(root / identity):
            if entry.is_file() and _is_image_name(entry.name):
                stat = entry.stat()
                item = (identity, (entry.name, stat.st_mtime_ns, stat.st_size))
                (linked if entry.is_symlink() else real).append((item, (stat.st_dev, stat.st_ino)))
    kept, dropped = _drop_linked_duplicates(real, linked)
    listing: Listing = {identity: [] for identity in identities}
    for identity, file in [item for item, _ in real] + kept:
        listing[identity].append(file)
    _warn_skipped(root, skipped, [f"{identity}/{file[0]}" for identity, file in dropped])
    return {identity: sorted(files) for identity, files in listing.items()}


def listing_signature(listing: Listing, limits: tuple[int, float] | None = None) -> str:
    """A hash of every identity name, file name, modification time and size in a listing.

    Args:
        listing: the output of :func:`list_identities`.
        limits: (max_pixels, max_aspect_ratio) the files were checked against; other limits
            give another signature, so the index is rebuilt.
    """
    digest = hashlib.sha256(f"facenet-index-v{INDEX_VERSION} {limits}\n".encode())
    for identity, files in listing.items():
        digest.update(f"D {identity}\n".encode())
        for name, mtime_ns, size in files:
            digest.update(f"F {name} {mtime_ns} {size}\n".encode())
    return digest.hexdigest()


def _index_path(root: Path, cache_dir: str | os.PathLike | None) -> Path:
    """Where the index of ``root`` is cached: next to the data, or in ``cache_dir``."""
    if cache_dir is None:
        return root / INDEX_FILE_NAME
    key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"facenet_index_{key}.json"


def _load_index(path: Path, signature: str) -> dict | None:
    """The cached index at ``path`` if it exists and matches ``signature``; else None."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("signature") != signature:
        return None
    if index.get("version") != INDEX_VERSION or not isinstance(index.get("identities"), dict):
        return None
    return index


def _save_index(path: Path, index: dict) -> None:
    """Write the index atomically; a read-only location only costs a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(index))
    except OSError as err:  # write_atomic has removed its temporary file
        warnings.warn(
            f"cannot write the dataset index {path}: {err.strerror or err}; "
            "the folder will be checked again next time",
            stacklevel=3,
        )


def _build_index(root: Path, listing: Listing, signature: str, limits: tuple[int, float]) -> dict:
    """Check every image's header (and PNG checksums); split usable and corrupt files."""
    pairs = [(identity, name) for identity, files in listing.items() for name, _, _ in files]
    with ThreadPoolExecutor(max_workers=_HEADER_CHECK_THREADS) as pool:
        reasons = list(pool.map(lambda p: inspect_image(root / p[0] / p[1], *limits), pairs))
    identities: dict[str, list[str]] = {identity: [] for identity in listing}
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


def _count(n: int, singular: str, plural: str) -> str:
    return f"{n} {singular if n == 1 else plural}"


def _names_for_warning(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_IN_WARNING])
    if len(names) > _NAMES_IN_WARNING:
        shown += f" and {len(names) - _NAMES_IN_WARNING} more"
    return shown


class IdentityFolder(Dataset):
    """Face images in ``root/<identity>/<image>``, one label per identity folder.

    Identities are numbered in sorted order of their folder names. A file that fails the checks
    short of decoding (:func:`~facenet.data.images.inspect_image`: a regular file, complete,
    its declared size within ``max_pixels`` and ``max_aspect_ratio``, a PNG's checksums) is
    dropped with one warning naming the files (``on_corrupt="skip"``) or raises
    :class:`CorruptImageError` (``on_corrupt="error"``); a file that passes them but still
    cannot be decoded raises :class:`CorruptImageError` naming it when loaded. Identity folders
    with no usable image are ignored with a warning. Identities with fewer than ``min_images``
    images stay in ``samples`` but are left out of triplet sampling (``triplet_labels`` is -1
    for them), with a warning.

    Attributes:
        samples: ``[(path, label), ...]``, grouped by identity.
        targets: the labels of ``samples``.
        classes: identity names; ``classes[label]`` is the folder of that label.
        class_to_idx: identity name -> label.
        triplet_labels: int64 array (N,): the label, or -1 where the identity has fewer than
            ``min_images`` images. Samplers draw only samples with a label >= 0.
        triplet_indices: int64 array of the dataset indices with ``triplet_labels >= 0``.
        skipped: paths of the corrupt files left out.
        index_path: where the index is cached.
        index_reused: True when the cached index matched the folder and nothing was re-checked.

    Args:
        root: the dataset folder.
        transform: applied to the uint8 (3, H, W) image; None returns the image as decoded.
        on_corrupt: "skip" or "error".
        cache_dir: where to cache the index; None caches it in ``root`` as
            ``.facenet_index.json``.
        min_images: identities with fewer images are left out of triplet sampling.
        exclude: identity names to leave out entirely (held out for evaluation).
        max_pixels: images declaring more pixels are corrupt for ``on_corrupt``.
        max_aspect_ratio: images declaring a longer side / shorter side above this, too.
        cache_bytes: keep decoded images (after ``transform.prepare`` where the transform has
            one) in memory up to this many bytes over all loading processes
            (:class:`~facenet.data.batches.DecodedCache`; 0: decode every time).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_corrupt: str = "skip",
        cache_dir: str | os.PathLike | None = None,
        min_images: int = 2,
        exclude: Collection[str] = (),
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
        cache_bytes: int = 0,
    ):
        if on_corrupt not in ("skip", "error"):
            raise ValueError(f"on_corrupt={on_corrupt!r}: expected 'skip' or 'error'")
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"dataset folder not found: {self.root}")
        self.transform = transform
        self.min_images = min_images
        self.limits = (int(max_pixels), float(max_aspect_ratio))
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
        self.triplet_labels = self._triplet_labels()
        self.triplet_indices = np.flatnonzero(self.triplet_labels >= 0)

    def _load_or_build_index(self, cache_dir: str | os.PathLike | None) -> dict:
        listing = list_identities(self.root)
        signature = listing_signature(listing, self.limits)
        path = _index_path(self.root, cache_dir)
        index = _load_index(path, signature)
        self.index_reused = index is not None
        if index is None:
            index = _build_index(self.root, listing, signature, self.limits)
            _save_index(path, index)
        self.index_path = path
        return index

    def _apply_corrupt_policy(self, corrupt: list, on_corrupt: str) -> list[str]:
        paths = [str(self.root / identity / name) for identity, name, _ in corrupt]
        if not paths:
            return []
        if on_corrupt == "error":
            more = f" ({len(paths) - 1} more corrupt files)" if len(paths) > 1 else ""
            raise CorruptImageError(paths[0], corrupt[0][2] + more)
        warnings.warn(
            f"{self.root}: skipped {len(paths)} corrupt or unreadable image(s): "
            + _names_for_warning(paths),
            stacklevel=3,
        )
        return paths

    def _usable_identities(self, identities: dict[str, list[str]]) -> list[str]:
        usable = [identity for identity, names in identities.items() if names]
        empty = [identity for identity, names in identities.items() if not names]
        if empty:
            warnings.warn(
                f"{self.root}: ignored {_count(len(empty), 'identity folder', 'identity folders')}"
                " without usable images: " + _names_for_warning(empty),
                stacklevel=3,
            )
        if len(usable) < 2:
            raise DataError(
                f"{self.root}: found {len(usable)} identity folder(s) with usable images; "
                "need at least 2 (layout: root/<identity>/<image>)"
            )
        return sorted(usable)

    def _triplet_labels(self) -> np.ndarray:
        labels = np.asarray(self.targets, dtype=np.int64)  # (N,)
        counts = np.bincount(labels, minlength=len(self.classes))  # (C,)
        too_few = counts < self.min_images
        if too_few.any():
            names = [self.classes[c] for c in np.flatnonzero(too_few)]
            warnings.warn(
                f"{self.root}: {_count(len(names), 'identity', 'identities')} with fewer than "
                f"{self.min_images} images left out of triplet sampling: "
                + _names_for_warning(names),
                stacklevel=3,
            )
        return np.where(too_few[labels], -1, labels)

    def images_by_identity(self) -> dict[str, list[str]]:
        """``{identity: [image path, ...]}`` over the usable images (for making pairs)."""
        result: dict[str, list[str]] = {name: [] for name in self.classes}
        for path, label in self.samples:
            result[self.classes[label]].append(path)
        return result

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """``(image, label)``; the image as ``transform`` makes it.

        Raises:
            CorruptImageError: the file cannot be decoded (it names the file).
        """
        path, label = self.samples[index]
        image = self.decoded.get(index)  # uint8 (3, H, W), or None
        if image is None:
            image = read_image(path, *self.limits)
            # A transform's deterministic first part (TrainCrops.prepare: the resize) is
            # cached with the image, so it runs once per image, not once per draw.
            prepare = getattr(self.transform, "prepare", None)
            image = prepare(image) if prepare is not None else image
            self.decoded.put(index, image)
        if self.transform is not None:
            image = self.transform(image)
        return image, label


def list_images(root: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Every image file under ``root`` (sorted), and its identity: the top-level folder name.

    Links are followed, but every real directory is visited once (see the module docstring):
    a loop through ``..`` ends, and a folder or an image reached twice is listed once, with one
    warning naming the links skipped.

    Args:
        root: a folder of identity folders (``root/<identity>/.../<image>``) or of images;
            hidden files and folders are left out.

    Returns:
        ``(paths, labels)``; the label of an image directly in ``root`` is "".
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    found, skipped_links, skipped_files = _walk_once(root)
    _warn_skipped(root, skipped_links, skipped_files)
    found.sort()
    labels = [
        p.relative_to(root).parts[0] if len(p.relative_to(root).parts) > 1 else "" for p in found
    ]
    return [str(p) for p in found], labels
