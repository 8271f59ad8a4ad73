"""Identities of an image folder held out of training, with identity-disjoint pairs for them.

The choice is drawn once (seeded) and recorded in ``heldout.json`` in the run directory; a
resumed run reads it back, so the held-out set stays fixed however the folder changes. Nothing
is written here: the record and the pairs files come back as texts for the run to write.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from facenet.data.images import DEFAULT_MAX_ASPECT_RATIO, DEFAULT_MAX_PIXELS, inspect_image
from facenet.data.pairs import draw_folds, pairs_text, scan_identities
from facenet.errors import ConfigError, DataError
from facenet.files import read_json

HELDOUT_RECORD = "heldout.json"
_OLD_HELDOUT_RECORD = "holdout.json"  # its name before the rename, still read on resume


@dataclass(frozen=True)
class HeldOutSettings:
    """``eval.heldout_identities`` and what its pairs are drawn with (``n_folds``,
    ``pairs_per_fold``, ``seed``) and from (the images the training index keeps)."""

    count: int
    n_folds: int = 10
    pairs_per_fold: int = 300
    seed: int = 0
    max_pixels: int = DEFAULT_MAX_PIXELS  # the images the training index keeps
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO


@dataclass
class HeldOut:
    """The held-out identities, each split's pairs file and the files still to write."""

    identities: tuple[str, ...]
    pairs: dict[str, str]
    pending: list[tuple[Path, str]]
    note: str


def choose_held_out(
    listing: dict, run_dir: Path, splits: list, settings: HeldOutSettings, fresh: bool
):
    """``({split: [identity, ...]}, record text to write or None)``: drawn for a new run
    (``fresh``: one in place of an earlier run), read back from the record otherwise."""
    record = run_dir / HELDOUT_RECORD
    if not record.exists() and (run_dir / _OLD_HELDOUT_RECORD).exists():
        record = run_dir / _OLD_HELDOUT_RECORD
    if record.exists() and not fresh:  # a FIFO or folder too: read_json refuses it
        chosen = read_json(record)
        if not isinstance(chosen, dict) or not all(
            isinstance(names, list) and all(isinstance(n, str) for n in names)
            for names in chosen.values()
        ):
            raise DataError(f"{record}: not a record of held-out identities")
        missing = sorted(n for names in chosen.values() for n in names if n not in listing)
        if missing:
            raise DataError(
                f"{record}: held-out identities no longer in the folder (with 2+ images): "
                f"{', '.join(missing[:5])}; restore them, or start a new run (--overwrite)"
            )
        return chosen, None
    count = settings.count
    if count < 2 * len(splits) or count > len(listing) - 2:
        raise ConfigError(
            f"eval.heldout_identities: {count}; between {2 * len(splits)} and "
            f"{len(listing) - 2} here ({len(listing)} identities with 2+ images; two must "
            "stay for training)"
        )
    names = sorted(random.Random(settings.seed).sample(sorted(listing), count))
    cut = len(names) // len(splits)
    chosen = {split: names[i * cut : (i + 1) * cut] for i, split in enumerate(splits)}
    chosen[splits[-1]] = names[(len(splits) - 1) * cut :]
    return chosen, json.dumps(chosen, indent=1)


def hold_out(
    root: Path, run_dir: Path, splits: list, settings: HeldOutSettings, fresh: bool
) -> HeldOut:
    """Hold ``settings.count`` identities of ``root`` out of training, with pairs for the
    ``splits`` ("val" and/or "test") to be written into ``run_dir``."""
    listing = {k: v for k, v in scan_identities(root).items() if len(v) >= 2}
    chosen, record = choose_held_out(listing, run_dir, splits, settings, fresh)
    limits = (settings.max_pixels, settings.max_aspect_ratio)
    pending = [] if record is None else [(run_dir / HELDOUT_RECORD, record)]
    pairs = {}
    for split, names in chosen.items():
        path = run_dir / f"{split}_pairs.txt"
        if fresh or not path.is_file():
            # The images the training index would keep (data.on_corrupt: skip).
            images = {
                n: [f for f in listing[n] if inspect_image(root / n / f, *limits) is None]
                for n in names
            }
            try:  # identity-disjoint folds when there are enough identities
                folds = draw_folds(images, settings.n_folds, settings.pairs_per_fold, settings.seed)
            except DataError as problem:
                raise ConfigError(
                    f"eval.heldout_identities: {settings.count}, eval.heldout_pairs_per_fold: "
                    f"{settings.pairs_per_fold}, eval.n_folds: {settings.n_folds}: too few "
                    f"{split} images for the pairs ({problem}); hold out more identities or ask "
                    "for fewer pairs"
                ) from None
            pending.append((path, pairs_text(folds)))
        pairs[split] = str(path)
    identities = tuple(n for names in chosen.values() for n in names)
    note = (
        f"held out {len(identities)} identities of {root} from training "
        f"(eval.heldout_identities, recorded in {run_dir / HELDOUT_RECORD}): "
        + ", ".join(f"{len(n)} for {s} ({pairs[s]})" for s, n in chosen.items())
    )
    return HeldOut(identities, pairs, pending, note)
