"""Image folders: walking ``root/<identity>/<image>`` trees, and :class:`IdentityFolder`.

Symbolic links are followed, but every real directory is visited once (remembered by
``(st_dev, st_ino)``, folders reached without a link first): a link back up (``up -> ..``) or to
a folder listed already is skipped, and so is a link to an image listed already, with one
warning naming them. ``IdentityFolder`` checks every image once and caches the result in a JSON
index keyed on its identity folders' own metadata (see :func:`_signature`: the images are not
stat-ed when it is reused), and holds its samples in numpy arrays: file names packed in one
byte buffer, labels in an int64 array, no Python object per image, so that DataLoader workers
share those pages instead of copying them as they touch reference counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from facenet.data.batches import DecodedCache
from facenet.data.images import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    CorruptImageError,
    inspect_images,
    read_image,
)
from facenet.errors import DataError, some_names
from facenet.files import read_json, write_text_atomic

INDEX_FILE_NAME = ".facenet_index.json"
# 2: PNG checksums and the size limits checked; reasons recorded. 3: keyed on the identity
# folders' metadata; dropped links recorded.
INDEX_VERSION = 3
_NAMES_IN_WARNING = 10
_prepared = {}  # index path -> the index prepare_index built or checked in this process


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


def _walk(root, max_depth=None, files=True):
    """``(folders, [(image path, stat), ...])`` under ``root``, folders down to ``max_depth``
    (``files=False``: no image listed, and the deepest folders' entries not read).

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
        if not files and max_depth is not None and depth + 1 >= max_depth:
            continue  # nothing below it is wanted
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
            elif files and entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS):
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


def _index_path(root, cache_dir):
    if cache_dir is None:
        return root / INDEX_FILE_NAME
    key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"facenet_index_{key}.json"


def _identity_folders(root):
    """``{identity: folder}`` of ``root``'s identity folders by name (links followed once)."""
    folders, _ = _walk(root, max_depth=2, files=False)
    return {folder.name: folder for folder in sorted(folders)}


def _signature(folders, limits):
    """A hash of the limits and each identity folder's own ``(device, inode, mtime, size)``.

    A folder's mtime changes when a file in it is added, removed, renamed or replaced by a
    rename (what copying tools do), so the files themselves are not stat-ed. What escapes it:
    a file rewritten in place under its name (its folder's mtime stays), and a change behind a
    link to a file elsewhere; touch the identity folder (or delete the index) after such a change.
    """
    keys = []
    for name, folder in folders.items():
        try:
            info = os.stat(folder)
        except OSError:  # gone since the listing: a key that matches no saved one
            keys.append([name, None])
            continue
        keys.append([name, info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size])
    text = json.dumps([INDEX_VERSION, limits, keys]).encode()
    return hashlib.sha256(text).hexdigest()


def _plain_name(name) -> bool:
    """A file name an index may hold: a string naming a file in its identity folder."""
    return (
        isinstance(name, str)
        and "/" not in name
        and "\0" not in name
        and name not in ("", ".", "..")
    )


def _fits(index, folders) -> bool:
    """A saved index names usable and corrupt files of the listed identity folders only (a
    hand-made or damaged one, whatever its signature, is rebuilt)."""
    try:
        identities, corrupt, links = index["identities"], index["corrupt"], index["links"]
        names_fit = all(
            isinstance(names, list) and all(map(_plain_name, names))
            for names in identities.values()
        )
        corrupt_fit = all(
            len(entry) == 3
            and entry[0] in folders
            and _plain_name(entry[1])
            and isinstance(entry[2], str)
            for entry in corrupt
        )
        links_fit = all(isinstance(link, str) for link in links)
        return identities.keys() == folders.keys() and names_fit and corrupt_fit and links_fit
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def _image_files(folder):
    """``[(name, (st_dev, st_ino) or None, link)]`` of the image files in ``folder``, by name.

    A file's inode comes with its directory entry; only links are stat-ed (None: unreadable).
    """
    try:
        device = os.stat(folder).st_dev
    except OSError:
        return []
    files = []
    for entry in _sorted_entries(folder):
        if entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS):
            link = entry.is_symlink()
            key = _key(entry.path) if link else (device, entry.inode())
            files.append((entry.name, key, link))
    return files


def _check_images(root, folders, limits, part):
    """``{identity: [(name, key, link, reason or None), ...]}`` for this part's identity
    folders (``part``: (rank, ranks); every ranks-th folder), with a progress bar."""
    rank, ranks = part
    mine = list(folders.items())[rank::ranks]
    listing = {identity: _image_files(folder) for identity, folder in mine}
    paths = [folders[i] / name for i, files in listing.items() for name, _, _ in files]
    # One progress line, part 0's (None: shown on a terminal only).
    hidden = None if rank == 0 else True
    checks = inspect_images(paths, *limits)
    bar = tqdm(checks, total=len(paths), desc=f"indexing {root}", unit="image", disable=hidden)
    reasons = iter(list(bar))
    return {
        identity: [(*file, next(reasons)) for file in files] for identity, files in listing.items()
    }


def _split_checked(checked):
    """``(identities, corrupt, links)`` from every part's checked files, in identity order: a
    link to a file listed already (or through an earlier link) is dropped, as the walk does."""
    files_seen = {key for _, files in checked for _, key, link, _ in files if not link}
    identities, corrupt, links = {}, [], []
    for identity, files in checked:
        identities[identity] = []
        for name, key, link, reason in files:
            if link and key is not None and key in files_seen:
                links.append(f"{identity}/{name}")
                continue
            files_seen.add(key)
            if reason is None:
                identities[identity].append(name)
            else:
                corrupt.append([identity, name, reason])
    return identities, corrupt, links


def _load_or_build(root, cache_dir, limits, part=(0, 1), gather=None):
    """``(index, reused)``: the index of ``root`` kept by :func:`prepare_index` or saved, if
    still valid; else one built now and saved by part 0 (``part`` and ``gather``: as
    :func:`prepare_index` takes them)."""
    folders = _identity_folders(root)
    signature = _signature(folders, limits)
    index_path = _index_path(root, cache_dir)
    index = _prepared.pop(str(index_path), None)
    if not (isinstance(index, dict) and index.get("signature") == signature):
        try:
            index = read_json(index_path)
        except DataError:
            index = None
    if isinstance(index, dict) and index.get("signature") == signature and _fits(index, folders):
        return index, True
    mine = _check_images(root, folders, limits, part)
    gathered = gather(mine) if gather is not None else [mine]
    checked = sorted((item for got in gathered for item in got.items()), key=lambda i: i[0])
    identities, corrupt, links = _split_checked(checked)
    index = {
        "version": INDEX_VERSION,
        "root": str(root.resolve()),
        "signature": signature,
        "identities": identities,
        "corrupt": corrupt,
        "links": links,
    }
    if part[0] == 0:
        _save_index(index_path, index)
    return index, False


def prepare_index(
    root: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    limits: tuple[int, float] = (DEFAULT_MAX_PIXELS, DEFAULT_MAX_ASPECT_RATIO),
    part: tuple[int, int] = (0, 1),
    gather: Callable[[dict], list[dict]] | None = None,
) -> bool:
    """Check or build the index of ``root``'s identity folders, and keep it in this process for
    the next :class:`IdentityFolder` of ``root`` (which then reads and checks nothing again);
    whether the saved index was reused. Nothing is done for a ``root`` that is not a folder
    (``IdentityFolder`` reports it).

    Several processes build it together: each calls this with its ``part`` (rank, ranks) and
    a ``gather`` returning every part's result in rank order (a collective, such as
    :func:`facenet.distributed.gather_objects`). Each checks every ranks-th identity folder, so
    none waits while another checks the whole set; part 0 saves the index.
    """
    root = Path(root)
    if not root.is_dir():
        return False
    limits = (int(limits[0]), float(limits[1]))
    index, reused = _load_or_build(root, cache_dir, limits, part, gather)
    _prepared[str(_index_path(root, cache_dir))] = index
    return reused


def _count(n, singular, plural):
    return f"{n} {singular if n == 1 else plural}"


def _warn(root, *parts):
    """One warning of the ``(what, names)`` parts that have names, up to 10 names each."""
    text = "; ".join(
        f"{what}: {some_names(names, _NAMES_IN_WARNING)}" for what, names in parts if names
    )
    if text:
        warnings.warn(f"{root}: {text}", stacklevel=4)


class FolderSamples(Sequence):
    """``(path, label)`` of each image of an :class:`IdentityFolder`, built when asked for from
    its packed arrays (a list's reading interface: indexing, slices, ``index``, iteration)."""

    def __init__(self, folder: IdentityFolder):
        self.folder = folder

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.folder.path(index), int(self.folder.targets[index])


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

    Per image it holds its file name's bytes plus 24 (an end offset, a label, a triplet label):
    ``samples`` builds ``(path, label)`` pairs when asked.
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
        index, self.index_reused = _load_or_build(self.root, cache_dir, self.limits)
        links = [self.root / link for link in index["links"]]
        _warn(self.root, _skipped_links(self.root, links, "files already listed"))
        self.skipped = self._apply_corrupt_policy(index["corrupt"], on_corrupt)
        excluded = set(exclude)
        kept = {k: v for k, v in index["identities"].items() if k not in excluded}
        self.classes = self._usable_identities(kept)
        self.class_to_idx = {name: label for label, name in enumerate(self.classes)}
        self._pack([kept[identity] for identity in self.classes])
        self.samples = FolderSamples(self)
        self.triplet_labels = self._triplet_labels()  # (N,) int64

    def _pack(self, names_by_class):
        """The file names in one byte buffer, each followed by a NUL (no file name holds one):
        ``names`` (bytes,) uint8, ``name_ends`` (N,) int64 (where each NUL is), ``targets``
        (N,) int64."""
        counts = [len(names) for names in names_by_class]  # (C,)
        self.targets = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # (N,)
        joined = "".join(name + "\0" for names in names_by_class for name in names)
        self.names = np.frombuffer(os.fsencode(joined), dtype=np.uint8)
        self.name_ends = np.flatnonzero(self.names == 0)  # (N,) int64

    def path(self, index: int) -> str:
        """The file of image ``index``."""
        end = int(self.name_ends[index])
        start = int(self.name_ends[index - 1]) + 1 if index > 0 else 0
        name = os.fsdecode(self.names[start:end].tobytes())
        return os.path.join(self.root, self.classes[self.targets[index]], name)

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
        labels = self.targets  # (N,)
        too_few = np.bincount(labels, minlength=len(self.classes)) < self.min_images  # (C,)
        names = [self.classes[c] for c in np.flatnonzero(too_few)]
        many = f"{_count(len(names), 'identity', 'identities')} with fewer than"
        _warn(self.root, (f"{many} {self.min_images} images left out of triplet sampling", names))
        return np.where(too_few[labels], -1, labels)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        decode = lambda: read_image(self.path(index), *self.limits)
        return self.decoded.item(index, decode, self.transform), int(self.targets[index])
