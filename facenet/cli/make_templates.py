"""Make a template set in insightface's IJB layout: ``facenet-make-templates SRC DST``.

SRC holds ``<identity>/<image>`` or ``<identity>/<media>/<image>`` (a sub-folder is one media, a
video or session; an image directly in an identity folder is a media of its own). Each
identity's media are shuffled with ``--seed`` and dealt into ``--templates-per-identity``
templates, a media never split; MTCNN gives every image its five landmarks and score, and images
without a face are left out (DST/make_templates_report.tsv lists them). DST gets
``loose_crop/<image>`` (hard links into SRC, copies where a link is impossible) and three meta
files: every pair of one identity's templates (genuine) and ``--impostor-pairs`` pairs of two
identities' templates drawn with ``--seed``. ``facenet-evaluate --ijb DST`` evaluates it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from argparse import Namespace
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from facenet.cli.common import (
    add_device_argument,
    add_threads_argument,
    check_out,
    check_outputs,
    int_in,
    parse_device,
    positive_int,
    run_command,
)
from facenet.data.folder import list_images
from facenet.distributed import set_threads
from facenet.errors import DataError
from facenet.files import write_atomic, write_text_atomic
from facenet.wings.align.aligner import (
    DEFAULT_DETECT_SIZE,
    REPORT_HEADER,
    Aligner,
    AlignOutcome,
    AlignSettings,
    Face,
)

# 100,000 impostor pairs read TAR at FAR 1e-4 from 10 false accepts, 1e-5 from one (IJB-C has
# 8,000,000 and 10,270 genuine ones); fewer are drawn where fewer exist.
DEFAULT_IMPOSTOR_PAIRS = 100_000
MAX_IMPOSTOR_PAIRS = 10_000_000
REPORT = "make_templates_report.tsv"
# insightface's scripts lower-case the set's name; 64 characters leave the meta files' and their
# temporary files' names within a file system's 255
_NAME = re.compile(r"[a-z0-9_]{1,64}")


def meta_files(name: str) -> dict[str, str]:
    """The meta files' paths relative to the set's root, by their content."""
    return {
        what: f"meta/{name}_{what}.txt"
        for what in ("face_tid_mid", "name_5pts_score", "template_pair_label")
    }


# --------------------------------------------------------------------------- grouping


def scan(src: Path) -> tuple[dict[str, dict[str, list[str]]], list[tuple[str, str, str]]]:
    """``{identity: {media: [image name, ...]}}`` (names relative to ``src``, POSIX, sorted)
    and the images left out as ``(status, path, reason)``."""
    real_src = src.resolve()
    media: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    left_out = []
    for path in list_images(src)[0]:
        parts = Path(path).relative_to(src).parts
        name = "/".join(parts)
        if len(parts) < 2:
            reason = "not in an identity folder"
        elif real_src not in Path(os.path.realpath(path)).parents:
            reason = f"a link out of {src}"
        elif any(c.isspace() for c in name):
            reason = "the name holds white space (the meta files are space-separated)"
        elif not name.isprintable():  # undecodable bytes arrive as surrogates
            reason = "the name is not printable UTF-8 (the meta files are UTF-8 text)"
        else:
            media[parts[0]][parts[1] if len(parts) > 2 else name].append(name)
            continue
        left_out.append(("left_out", os.fsencode(path).decode("utf-8", "backslashreplace"), reason))
    return media, left_out


def _images(media: dict[str, dict[str, list[str]]]) -> list[str]:
    """Every image name of ``{identity: {media: [image name, ...]}}``, sorted."""
    return sorted(name for m in media.values() for names in m.values() for name in names)


def group_templates(media: dict[str, dict[str, list[str]]], k: int, rng):
    """Each identity's media (sorted by identity) dealt into its ``k`` templates after a
    shuffle: ``[(identity, [media, ...]), ...]``, and the identities with too few media."""
    templates, dropped = [], []
    for identity in sorted(media):
        keys = sorted(media[identity])
        if len(keys) < k:
            dropped.append(identity)
            continue
        order = [keys[i] for i in rng.permutation(len(keys))]
        templates += [(identity, sorted(order[t::k])) for t in range(k)]
    return templates, dropped


def impostor_pairs(identity_of: np.ndarray, count: int, rng) -> np.ndarray:
    """``(M, 2)`` distinct template index pairs ``i < j`` of two identities, sorted; ``M`` is
    ``count`` or every such pair where there are fewer. ``identity_of``: (T,) integer labels."""
    n = len(identity_of)
    sizes = np.bincount(identity_of)
    available = n * (n - 1) // 2 - int((sizes * (sizes - 1) // 2).sum())
    if available <= 2 * count:  # enumerate all; rejection would rarely hit a new pair
        i, j = np.triu_indices(n, 1)
        keep = identity_of[i] != identity_of[j]
        pick = rng.choice(available, min(count, available), replace=False)
        codes = (i[keep] * n + j[keep])[pick]
    else:
        codes = np.empty(0, dtype=np.int64)
        while len(codes) < count:  # each round keeps the first draw of every pair
            a, b = rng.integers(0, n, (2, count))
            keep = identity_of[a] != identity_of[b]
            drawn = np.minimum(a, b)[keep] * n + np.maximum(a, b)[keep]
            both = np.concatenate([codes, drawn])
            codes = both[np.sort(np.unique(both, return_index=True)[1])]
        codes = codes[:count]
    codes = np.sort(codes)
    return np.stack([codes // n, codes % n], axis=1)


def pair_rows(identity_of: np.ndarray, args: Namespace, rng) -> np.ndarray:
    """``(P, 3)`` rows ``template index, template index, label`` (1 genuine, 0 impostor), by
    first and second index: every pair of one identity's templates (the
    ``--templates-per-identity`` of each lie together) and the drawn ``--impostor-pairs``."""
    a, b = np.triu_indices(args.templates_per_identity, 1)
    starts = np.arange(0, len(identity_of), args.templates_per_identity)[:, None]  # (I, 1)
    genuine = np.stack([(starts + a).ravel(), (starts + b).ravel()], axis=1)
    genuine = np.column_stack([genuine, np.ones(len(genuine), np.int64)])
    other = impostor_pairs(identity_of, args.impostor_pairs, rng)
    rows = np.concatenate([genuine, np.column_stack([other, np.zeros(len(other), np.int64)])])
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))]


# --------------------------------------------------------------------------- detection, files


def detect(src: Path, names: list[str], args: Namespace) -> dict[str, Face | AlignOutcome]:
    """Each image's face (MTCNN as facenet-align's template presets search), or why none."""
    settings = AlignSettings.from_preset("arcface", detect_size=args.detect_size)
    aligner = Aligner(settings, parse_device(args.device))
    found = {}
    with tqdm(total=len(names), desc="detecting", unit="img", disable=not args.progress) as bar:
        for start in range(0, len(names), args.batch_size):
            chunk = names[start : start + args.batch_size]
            found.update(zip(chunk, aligner.detect_files([str(src / n) for n in chunk])))
            bar.update(len(chunk))
    return found


def meta_lines(templates, media, found: dict[str, Face], rows: np.ndarray) -> list[list[str]]:
    """The three files' lines (as :func:`meta_files` orders them); images by template, media
    and name, in the same order in the first two (insightface reads them side by side); template
    and media ids count from 1, landmarks and score with insightface's three decimals."""
    tid_mid, five_points, mid = [], [], 0
    for tid, (identity, keys) in enumerate(templates, start=1):
        for key in keys:
            mid += 1
            for name in media[identity][key]:
                face = found[name]
                values = [*np.asarray(face.landmarks).ravel(), face.probability]
                tid_mid.append(f"{name} {tid} {mid}")
                five_points.append(" ".join([name, *(f"{v:.3f}" for v in values)]))
    pairs = [f"{a + 1} {b + 1} {label}" for a, b, label in rows.tolist()]
    return [tid_mid, five_points, pairs]


def link(source: str, target: Path) -> None:
    """``target`` made a hard link to ``source`` (a copy where a link is impossible: another
    file system, a full link count), atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        with open(source, "rb") as fh:
            write_atomic(target, lambda out: shutil.copyfileobj(fh, out))


def check_dst(src: Path, dst: Path, args: Namespace, names: list[str]) -> None:
    """Refuse, before any work, a DST overlapping SRC, or holding anything unless
    ``--overwrite`` (which replaces only regular files of the names this command writes)."""
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_src in (real_dst, *real_dst.parents) or real_dst in real_src.parents:
        raise DataError(f"{dst} and {src} overlap: give a DST outside SRC and not above it")
    check_out(dst)
    if not args.overwrite and os.path.lexists(dst) and (not dst.is_dir() or any(dst.iterdir())):
        raise DataError(
            f"{dst} exists and is not empty: --overwrite replaces this command's "
            "earlier output, or choose another DST"
        )
    files = [*meta_files(args.name).values(), REPORT, *(f"loose_crop/{n}" for n in names)]
    outputs = Namespace(out=str(dst), overwrite=args.overwrite)
    check_outputs(outputs, *files, folders={"SRC": src})  # a link among DST's folders too


# --------------------------------------------------------------------------- the command


def _enough(media, k: int, what: str) -> None:
    """Refuse fewer than two identities with ``k`` media: one alone gives no impostor pair."""
    ready = sum(len(m) >= k for m in media.values())
    if ready < 2:
        most = max((len(m) for m in media.values()), default=0)
        raise DataError(
            f"{what}: {ready} of {len(media)} identities have {k} media (images or "
            f"sub-folders) for --templates-per-identity {k}, the most any has is {most}; "
            "impostor pairs need two"
        )


def _faces(src: Path, media, args: Namespace):
    """``media`` cut to the images with a face, their faces, and the report rows of the rest."""
    found = detect(src, _images(media), args)
    report = [(o.status, o.source, o.reason) for o in found.values() if not isinstance(o, Face)]
    kept = {
        i: {k: [n for n in v if isinstance(found[n], Face)] for k, v in m.items()}
        for i, m in media.items()
    }
    return {i: {k: v for k, v in m.items() if v} for i, m in kept.items()}, found, report


def _write_set(src: Path, dst: Path, name: str, lines, report) -> None:
    """Links first, meta files after: a crash leaves no meta file naming a missing image."""
    for image in (line.split(" ", 1)[0] for line in lines[0]):
        link(os.path.realpath(src / image), dst / "loose_crop" / image)
    (dst / "meta").mkdir(parents=True, exist_ok=True)
    for path, text in zip(meta_files(name).values(), lines):
        write_text_atomic(dst / path, "".join(f"{line}\n" for line in text))
    rows = sorted(report, key=lambda row: row[1])
    write_text_atomic(
        dst / REPORT, REPORT_HEADER.decode() + "".join("\t".join(row) + "\n" for row in rows)
    )


def _make(args: Namespace) -> int:
    set_threads(args.threads)
    start, src, dst = time.perf_counter(), Path(args.src), Path(args.dst)
    k = args.templates_per_identity
    if not _NAME.fullmatch(args.name):
        raise DataError(f"--name {args.name!r}: expected 1 to 64 lower-case letters, digits, _")
    if not src.is_dir():
        raise DataError(f"source folder not found: {src}")
    media, report = scan(src)
    check_dst(src, dst, args, _images(media))
    _enough(media, k, str(src))
    media, found, missed = _faces(src, media, args)
    _enough(media, k, f"{src} (images with a face)")
    templates, dropped = group_templates(media, k, np.random.default_rng(args.seed))
    report += missed + [
        ("too_few_media", str(src / i), f"{len(media[i])} media with a face") for i in dropped
    ]
    identity_of = np.unique([identity for identity, _ in templates], return_inverse=True)[1]
    rows = pair_rows(identity_of, args, np.random.default_rng(args.seed))
    lines = meta_lines(templates, media, found, rows)
    _write_set(src, dst, args.name, lines, report)
    n = Counter(status for status, _, _ in report)
    print(
        f"{len(templates) // k} identities, {len(templates)} templates, {len(lines[0])} images;"
        f" {int(rows[:, 2].sum())} genuine and {int((rows[:, 2] == 0).sum())} impostor pairs; "
        f"left out: no face {n['no_face']}, unreadable {n['unreadable']}, other "
        f"{n['left_out']}, identities with too few media {n['too_few_media']} "
        f"({time.perf_counter() - start:.1f} s); report: {dst / REPORT}"
    )
    return 0


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-make-templates``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="folder of <identity>/<image> or <identity>/<media>/<image>")
    parser.add_argument("dst", help="folder for the set (loose_crop/, meta/)")
    parser.add_argument(
        "--name", default="templates", help="meta files' prefix (default templates)"
    )
    parser.add_argument(
        "--templates-per-identity",
        type=int_in(2, 1000),  # one template per identity: no genuine pair
        default=2,
        metavar="K",
        help="templates each identity's media are dealt into (default 2: one genuine pair)",
    )
    parser.add_argument(
        "--impostor-pairs",
        type=int_in(1, MAX_IMPOSTOR_PAIRS),
        default=DEFAULT_IMPOSTOR_PAIRS,
        metavar="N",
        help=f"pairs of two identities' templates (default {DEFAULT_IMPOSTOR_PAIRS})",
    )
    parser.add_argument("--seed", type=int_in(0), default=0, help="grouping and pairs (default 0)")
    parser.add_argument(
        "--detect-size",
        type=int_in(20, zero=True),
        default=DEFAULT_DETECT_SIZE,
        help=f"longer side MTCNN searches; 0: the full image (default {DEFAULT_DETECT_SIZE})",
    )
    add_device_argument(parser, "cpu")  # where MTCNN runs
    add_threads_argument(parser)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per MTCNN call")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace this command's earlier output"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Make the set; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _make(args))


if __name__ == "__main__":
    sys.exit(main())
