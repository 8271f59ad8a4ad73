"""Verification with the LFW protocol: accuracy, VAL@FAR, AUC, EER and the ROC curve.

Pair distances come from ``--distances FILE`` (an ``.npz`` with arrays ``distances`` and
``issame``, or a ``.csv`` of ``distance,issame`` rows; similarities with ``--similarities``), or
from a model (``--checkpoint``) embedding a pairs.txt (``--pairs``) or insightface ``.bin`` sets
(``--bin``, one table row each). Prints a table and writes into ``--out`` ``metrics.json``
(with the threshold, its distance, ``same_when`` and ``threshold_for``: the weights and
preparation it was chosen for) and ``roc.png`` (``roc_<name>.png`` per ``--bin``);
``--show-errors N`` with ``--pairs`` adds ``errors.png``, the N worst false rejects and false
accepts at the deployable accuracy threshold (:mod:`facenet.wings.audit.pair_errors`).
``--retrieval ROOT`` embeds an identity folder instead and writes its Precision@1, R-Precision
and MAP@R (:mod:`facenet.wings.retrieval`) to ``metrics.json``; ``--ijb ROOT`` verifies the
templates of a set in insightface's IJB layout (:mod:`facenet.wings.templates.protocol`,
docs/templates.md) and writes ``metrics.json``, ``roc.png`` and ``features.npz``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Mapping
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import numpy as np

from facenet.checkpoint import load_checkpoint
from facenet.cli.common import (
    add_device_argument,
    add_out_arguments,
    add_threads_argument,
    check_outputs,
    int_in,
    parse_device,
    positive_int,
    read_pairs_of,
    run_command,
)
from facenet.config import Config, DataConfig, config_from_dict, load_config
from facenet.data.folder import list_images
from facenet.data.images import EVAL_PREPROCESS
from facenet.data.pairs import PairList
from facenet.distributed import set_threads
from facenet.errors import DataError
from facenet.evaluation.distances_file import read_distances
from facenet.evaluation.plots import plot_roc, plot_tar
from facenet.evaluation.presets import (
    CLASSIC,
    EVAL_PRESETS,
    FEATURES,
    GRIDS,
    PUBLISHER_FIELDS,
    SCORINGS,
    THRESHOLD_RULES,
    SettingsError,
    VerifySettings,
    flag_for,
)
from facenet.evaluation.protocol import VerificationResult
from facenet.evaluation.report import result_table, sets_table
from facenet.evaluation.verify import verify, verify_distances
from facenet.files import write_atomic, write_text_atomic
from facenet.metric.distances import DISTANCE_NAMES
from facenet.wings.after_training.embed import embed_folder
from facenet.wings.after_training.loading import load_model
from facenet.wings.after_training.thresholds import deployable_lines, deployable_thresholds
from facenet.wings.align.aligner import align_face
from facenet.wings.align.presets import TEMPLATES
from facenet.wings.audit.pair_errors import error_sheet
from facenet.wings.audit.sheets import write_png
from facenet.wings.publishers.insightface_bin import BIN_PREPROCESS, read_bin
from facenet.wings.retrieval import retrieval_metrics
from facenet.wings.templates.ijb import read_template_set
from facenet.wings.templates.protocol import (
    TemplateSettings,
    WarpedFaces,
    choose_template,
    embed_faces,
    verify_templates,
)


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-evaluate``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--distances", help=".npz (distances, issame) or .csv (distance,issame)")
    parser.add_argument(
        "--similarities",
        action="store_true",
        help="--distances holds similarities (higher: same identity), scored as 1 - similarity",
    )
    source.add_argument(
        "--checkpoint", help="a checkpoint, model.pt or facenet-pytorch file to embed with"
    )
    parser.add_argument(
        "--config", help="a run configuration whose eval section gives the defaults below"
    )
    parser.add_argument("--pairs", help="pairs.txt (with --checkpoint)")
    parser.add_argument(
        "--bin",
        action="append",
        default=[],
        help="an insightface .bin verification set (with --checkpoint); repeatable",
    )
    parser.add_argument(
        "--retrieval", help="identity folder: Precision@1, R-Precision, MAP@R (with --checkpoint)"
    )
    parser.add_argument(
        "--ijb", help="a set in insightface's IJB layout: TAR@FAR of templates (with --checkpoint)"
    )
    parser.add_argument("--root", help="image folder of --pairs (default: its folder)")
    add_out_arguments(parser, "where metrics.json and roc.png go", "runs/evaluate")
    _add_protocol_arguments(parser)
    parser.add_argument(
        "--linear-far",
        dest="log_scale",
        action="store_false",
        help="linear FAR axis in the ROC (default: logarithmic, where VAL is read)",
    )
    parser.add_argument("--title", default=None, help="ROC plot title")
    add_threads_argument(parser)
    _add_embedding_arguments(parser.add_argument_group("checkpoint mode"))
    _add_ijb_arguments(parser.add_argument_group("--ijb (docs/templates.md)"))
    return parser


def _add_protocol_arguments(parser) -> None:
    """The protocol's options, in both modes."""
    parser.add_argument(
        "--folds",
        dest="n_folds",
        type=int,
        help="number of folds (default: a pairs file's own, else 10); must match a pairs file's",
    )
    parser.add_argument("--far-target", type=float, help="FAR for VAL (1e-3)")
    parser.add_argument(
        "--distance",
        choices=DISTANCE_NAMES,
        help="metric of the distances (chooses the threshold grids) or to measure embeddings",
    )
    parser.add_argument(
        "--preset",
        choices=tuple(EVAL_PRESETS),
        help="a publisher's evaluation (distance, flip, mean subtraction, preprocessing, grids, "
        "features, threshold rule, scoring; docs/reproduce.md); flags given still win",
    )
    parser.add_argument(
        "--grid",
        choices=GRIDS,
        help=(
            "threshold grids: from the distance, the publishers' [0, 4) for any distance, or "
            "MobileFaceNet_Pytorch's cosine similarities in steps of 1e-4"
        ),
    )
    parser.add_argument(
        "--threshold-rule",
        choices=THRESHOLD_RULES,
        help=(
            "each fold's threshold: the first best on the training folds (classic) or the mean "
            "of every best one (MobileFaceNet_Pytorch's lfw_eval.py)"
        ),
    )


def _add_embedding_arguments(embed) -> None:
    """The options of checkpoint mode: how images are embedded."""
    embed.add_argument("--flip", action="store_true", help="concatenate flipped-image embeddings")
    embed.add_argument(
        "--preprocess",
        choices=EVAL_PREPROCESS,
        help="resize: 1.125 S then the centre S; crop: no resize, the centre S of aligned crops",
    )
    embed.add_argument("--subtract-mean", action="store_true", help="classic mean subtraction")
    embed.add_argument(
        "--features",
        choices=FEATURES,
        help="the network's unit embeddings or its raw outputs before L2 normalisation",
    )
    embed.add_argument(
        "--scoring",
        choices=SCORINGS,
        help="the distance in float64, or lfw_eval.py's cosine in float32 (MobileFaceNet_Pytorch)",
    )
    embed.add_argument("--batch-size", type=positive_int, help="images per forward")
    add_device_argument(embed, "cpu")
    embed.add_argument("--skip-missing", action="store_true", help="skip pairs missing images")
    embed.add_argument(
        "--show-errors",
        type=positive_int,
        metavar="N",
        help="with --pairs: errors.png, the N worst false rejects and false accepts at the "
        "deployable accuracy threshold (docs/audit.md)",
    )


def _add_ijb_arguments(ijb) -> None:
    """insightface's flags of eval_ijbc.py, on by default as there."""
    ijb.add_argument("--ijb-set", help="the <name> of ROOT/meta/<name>_*.txt (default: the only)")
    ijb.add_argument(
        "--template",
        choices=tuple(TEMPLATES),
        help="landmark template (default: the one of the model's input size)",
    )
    ijb.add_argument(
        "--no-flip-test", dest="flip_test", action="store_false", help="no mirror features added"
    )
    ijb.add_argument(
        "--no-detector-score",
        dest="detector_score",
        action="store_false",
        help="features not weighted by the detector score",
    )
    ijb.add_argument(
        "--no-norm-score",
        dest="norm_score",
        action="store_false",
        help="image features made unit length before pooling",
    )
    ijb.add_argument(
        "--workers", type=int_in(0), default=0, help="processes reading and warping faces"
    )


def config_defaults(path: str) -> dict:
    """The command line's defaults from a run configuration's ``eval`` section."""
    cfg = load_config(path)
    e = cfg.eval
    out = {"pairs": e.pairs, "root": e.root, "log_scale": e.log_scale_roc}
    return {**out, **vars(VerifySettings.of(e)), "out": cfg.logging.out_dir}


# The eval keys a training checkpoint hands facenet-evaluate: how its run measured pairs, not
# where its pairs were nor how its machine loaded them.
RUN_FIELDS = (*PUBLISHER_FIELDS, "n_folds", "far_target", "batch_size")


def run_settings(path: str) -> Config | None:
    """The evaluation settings a training checkpoint's run used (its saved ``eval`` keys of
    :data:`RUN_FIELDS`, checked as a configuration's), or None for a file without them."""
    saved = load_checkpoint(path).get("config")
    section = saved.get("eval") if isinstance(saved, Mapping) else None
    if not isinstance(section, Mapping):  # a weights export or a publisher's file
        return None
    kept = {key: value for key, value in section.items() if key in RUN_FIELDS}
    return config_from_dict({"eval": kept}, f"{path}'s saved configuration")


def _settings_line(args: argparse.Namespace, trained) -> str:
    """One line: where the evaluation settings came from (``args.settings_from``), the values
    in use, the flags that overrode them and the preprocessing the checkpoint fixes."""
    settings, values = VerifySettings.of(args), []
    for name in RUN_FIELDS:
        value = getattr(settings, name)
        shown = ("off", "on")[value] if isinstance(value, bool) else value
        mark = " (the pairs file's)" if name == "n_folds" and args.folds_of_pairs else ""
        values.append(f"{name.replace('_', ' ')} {shown}{mark}")
    values.append(f"image size {trained.image_size}, {trained.normalize} normalisation")
    where = f"{args.checkpoint}: " if args.settings_from == "the run's" else ""
    flags = [flag_for(name) for name in RUN_FIELDS if name in args.given]
    given = f"; from the command line: {', '.join(flags)}" if flags else ""
    return f"evaluation settings: {args.settings_from} ({where}{', '.join(values)}){given}"


def _load(args: argparse.Namespace) -> tuple:
    """(the checkpoint's ``TrainedModel``, its network on ``--device``, the device), with the
    settings of its run where they apply (:func:`_apply_run_settings`)."""
    trained, device = load_model(args.checkpoint), parse_device(args.device)
    _apply_run_settings(args)
    return trained, trained.model.to(device), device


def _threshold_for(args: argparse.Namespace, trained, provenance: dict) -> dict:
    """metrics.json's ``threshold_for``: the weights and preparation a threshold was chosen for."""
    weights = {"checkpoint": str(args.checkpoint), "weights_sha256": trained.weights_sha256()}
    return {**weights, "epoch": trained.epoch, **provenance}


def _check_outputs(args: argparse.Namespace, *names: str) -> None:
    """Before any work: the files ``names`` in ``--out`` replace neither anything but this
    command's earlier output nor any input."""
    read = ("distances", "checkpoint", "config", "pairs", "root", "bin")
    files = {f"--{key}": getattr(args, key) for key in read}
    folders = {"--retrieval": args.retrieval, "--ijb": args.ijb}
    check_outputs(args, *names, files=files, folders=folders)


def _write_metrics(args: argparse.Namespace, record: dict) -> Path:
    """``record`` as ``--out``/metrics.json (the folder made first); returns the folder."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "metrics.json", json.dumps(record, indent=1) + "\n")
    return out


def _embedding_setup(args: argparse.Namespace) -> tuple:
    """(pairs -> (``VerificationResult``, deployable thresholds, (N,) distances without mean
    subtraction) of the checkpoint's model, ``threshold_for``)."""
    trained, model, device = _load(args)
    settings = VerifySettings.of(args)
    print(_settings_line(args, trained))

    def measure(pairs):  # the thresholds on distances without mean subtraction, as identify's
        result, distances = verify(
            model,
            pairs,
            trained.image_size,
            settings,
            normalize=trained.normalize,
            device=device,
            return_distances=True,
        )
        folds = pairs.folds_for(args.n_folds) if isinstance(pairs, PairList) else None
        found = deployable_thresholds(distances, pairs.issame, settings, folds)
        return result, found | {"subtract_mean": False}, distances

    return measure, _threshold_for(args, trained, settings.provenance())


def _bin_sets(args: argparse.Namespace) -> tuple[dict, dict]:
    """(metrics.json, ``{set name: result}``) of every ``--bin`` set; two sets of one name are
    refused."""
    paths = {}
    for path in args.bin:
        name = Path(path).stem
        if name in paths:
            raise DataError(f"--bin {path}: a second set named {name!r}")
        paths[name] = path
    data = load_config(args.config).data if args.config else DataConfig()
    limits = (data.max_image_pixels, data.max_aspect_ratio)  # data.*: the config's, if given
    measure, threshold_for = _embedding_setup(args)
    threshold_for["preprocess"] = BIN_PREPROCESS  # the sets' own, whatever --preprocess says
    results, sets = {}, {}
    for name, path in paths.items():
        pairs = read_bin(path, args.n_folds, limits)
        results[name], deployable, _ = measure(pairs)
        sets[name] = {**results[name].to_dict(curves=False), "deployable_thresholds": deployable}
    return {"source": str(args.checkpoint), "threshold_for": threshold_for, "sets": sets}, results


def _single(args: argparse.Namespace) -> tuple[str, dict, VerificationResult]:
    """(name, metrics.json's source fields, result) of ``--distances`` or of ``--checkpoint``
    on ``--pairs``."""
    if args.mode == "distances":
        source = str(args.distances)
        scores, issame = read_distances(source)
        distances = 1 - scores if args.similarities else scores
        settings = replace(VerifySettings.of(args), flip=False)  # as verify_distances grids
        result = verify_distances(distances, issame, settings, source)
        fields = {
            "source": source,
            "threshold_for": {"distances": source},  # measured elsewhere: weights not known
            "deployable_thresholds": deployable_thresholds(distances, issame, settings),
        }
        return Path(args.distances).name, fields, result

    pairs = read_pairs_of(args)
    _apply_run_settings(args)
    args.n_folds = _pairs_folds(args, pairs)
    measure, threshold_for = _embedding_setup(args)
    result, deployable, distances = measure(pairs)
    if args.show_errors:  # at the threshold to deploy: on distances without mean subtraction
        threshold = deployable["accuracy"]["threshold"]
        sheet = error_sheet(pairs, distances, threshold, args.show_errors, args.distance)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_png(Path(args.out, "errors.png"), sheet)
    fields = {"source": f"{args.checkpoint} on {args.pairs}", "threshold_for": threshold_for}
    return Path(args.pairs).name, fields | {"deployable_thresholds": deployable}, result


def _pairs_folds(args: argparse.Namespace, pairs: PairList) -> int:
    """The folds ``pairs`` are evaluated in: its header's count, which a count the user gave
    (``args.folds_from``) must equal; a one-fold file is cut into the folds asked for."""
    args.folds_of_pairs = pairs.n_folds > 1  # the settings line says whose count it is
    if pairs.n_folds == 1:
        return args.n_folds
    if args.folds_from and args.n_folds != pairs.n_folds:
        raise DataError(
            f"{args.folds_from} {args.n_folds}: {args.pairs} holds {pairs.n_folds} folds (its "
            f"header); give {pairs.n_folds} or leave the count out"
        )
    return pairs.n_folds


def _retrieval(args: argparse.Namespace) -> None:
    """Every image of ``--retrieval`` embedded as the checkpoint was trained, then retrieved."""
    _check_outputs(args, "metrics.json")
    flat = list_images(args.retrieval)[1].count("")  # labels: "" for an image not in a folder
    if flat:  # all would count as one identity: every figure 1.0
        raise DataError(
            f"--retrieval {args.retrieval}: {flat} image(s) outside identity folders; "
            "retrieval needs ROOT/<identity>/<image>"
        )
    trained, model, device = _load(args)
    settings = VerifySettings.of(args)
    print(_settings_line(args, trained))
    found = embed_folder(
        model, args.retrieval, trained.image_size, settings, trained.normalize, device
    )
    labels, counts = np.unique(found.labels, return_inverse=True, return_counts=True)[1:]
    if counts.max(initial=0) < 2:  # no query has a relevant row: every figure NaN
        raise DataError(
            f"--retrieval {args.retrieval}: no identity has two readable images to query"
        )
    record = {
        "source": f"{args.checkpoint} on {args.retrieval}",
        "unreadable": len(found.unreadable),
    }
    record |= retrieval_metrics(found.embeddings, labels)
    shown = {key: value for key, value in record.items() if key != "source"}
    print(
        ", ".join(
            f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
            for key, value in shown.items()
        )
    )
    _write_metrics(args, record)


def _ijb_record(args, faces, result, settings: TemplateSettings, trained) -> dict:
    """metrics.json of ``--ijb``: TAR at each FAR, AUC, counts, settings, source, and the
    deployable thresholds on 1 - score with what they were chosen for."""
    provenance = {
        "flip": settings.flip_test,
        "subtract_mean": False,
        "preprocess": f"template {settings.template}",  # pooled features: identify refuses them
        "features": settings.features,
    }
    return {
        "source": f"{args.checkpoint} on {faces.meta('_*.txt')}",
        "tar_at_far": result.tar_at_far(),
        "auc": result.auc,
        "counts": {
            "images": len(faces.images),
            "media": len(np.unique(np.c_[faces.templates, faces.media], axis=0)),
            "templates": len(result.template_ids),
            "genuine_pairs": int(faces.labels.sum()),
            "impostor_pairs": int((faces.labels == 0).sum()),
        },
        "settings": asdict(settings),
        "weights_sha256": trained.weights_sha256(),
        "threshold_for": _threshold_for(args, trained, provenance),
        "deployable_thresholds": _template_thresholds(args, faces.labels, result.scores),
        "threshold_distance": "cosine",  # the deployable thresholds are on 1 - score
    }


def _template_thresholds(args: argparse.Namespace, labels: np.ndarray, scores: np.ndarray):
    """Deployable thresholds on 1 - cosine of the template pairs; folds dealt round-robin within
    each kind, since a template pair list need not mix kinds in contiguous runs; none (``{}``)
    with fewer than two pairs of a kind."""
    n_folds = min(args.n_folds, int(labels.sum()), int((labels == 0).sum()))
    if n_folds < 2:  # a fold needs a pair of each kind
        warnings.warn(
            f"--ijb: no deployable thresholds: {int(labels.sum())} genuine and "
            f"{int((labels == 0).sum())} impostor pairs, and a fold needs one of each in each "
            "of at least two folds",
            stacklevel=2,
        )
        return {}
    settings = replace(VerifySettings.of(args), distance="cosine", grid="default", n_folds=n_folds)
    same = labels == 1
    folds = (np.where(same, np.cumsum(same), np.cumsum(~same)) - 1) % n_folds  # rank in its kind
    return deployable_thresholds(1 - scores, labels, settings, folds)


def _ijb(args: argparse.Namespace) -> None:
    """The templates of ``--ijb`` pooled from the checkpoint's features, their pairs verified."""
    _check_outputs(args, "metrics.json", "roc.png", "features.npz")
    faces = read_template_set(args.ijb, args.ijb_set)
    trained, model, device = _load(args)
    template = choose_template(trained.image_size, args.template)
    settings = replace(TemplateSettings.of(args), template=template)
    warped = WarpedFaces(
        faces, partial(align_face, template=template), trained.image_size, trained.normalize
    )
    features = embed_faces(model, warped, device, settings)
    result = verify_templates(faces, features, settings)
    record = _ijb_record(args, faces, result, settings, trained)
    print(result.tar_line())
    print(f"AUC {result.auc:.4f}: {len(faces.labels)} pairs, {len(result.template_ids)} templates")
    for line in deployable_lines(record["deployable_thresholds"]):
        print(line)
    # everything a figure is computed from (tools/ijb_from_features.py recomputes them)
    arrays = {
        "image_names": faces.images,
        "image_templates": faces.templates,
        "image_media": faces.media,
        "image_scores": faces.scores,
        "image_features": features,
        "template_ids": result.template_ids,
        "template_features": result.template_features,
        "pairs": faces.pairs,
        "labels": faces.labels,
        "scores": result.scores,
        "detector_score": settings.detector_score,
        "norm_score": settings.norm_score,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "features.npz", lambda fh: np.savez(fh, **arrays))
    figure = plot_tar(result, args.title or f"{faces.name} ({len(faces.labels)} pairs)")
    write_atomic(out / "roc.png", lambda fh: figure.savefig(fh, format="png"))
    _write_metrics(args, record)
    print(f"wrote {out / 'metrics.json'}, roc.png and features.npz")


def _evaluate(args: argparse.Namespace) -> None:
    """Check the options and ``--out``, evaluate, print the table and write the files."""
    set_threads(args.threads)
    if args.mode == "retrieval":
        return _retrieval(args)
    if args.mode == "ijb":
        return _ijb(args)
    out = Path(args.out)
    rocs = [f"roc_{Path(path).stem}.png" for path in args.bin] or ["roc.png"]
    # before the work, not after it
    _check_outputs(args, "metrics.json", *rocs, *(["errors.png"] if args.show_errors else []))
    if args.mode == "bin":
        record, results = _bin_sets(args)
        print(sets_table(results))
        for name, values in record["sets"].items():
            print("\n".join(deployable_lines(values["deployable_thresholds"], name)))
        wrote = "a roc_<set>.png for each set"
    else:
        name, fields, result = _single(args)
        print(result_table(name, result))
        print("\n".join(deployable_lines(fields["deployable_thresholds"])))
        record, results, wrote = {**fields, **result.to_dict()}, {"": result}, out / "roc.png"
    record["same_when"] = f"{'1 - similarity' if args.similarities else 'distance'} < threshold"
    _write_metrics(args, record)
    for file, (name, result) in zip(rocs, results.items()):  # name "": --pairs or --distances
        title = f"{name} ({result.n_pairs} pairs)" if name else None
        roc = plot_roc(result, log_scale=args.log_scale, title=args.title or title)  # a Figure
        # replaced whole, never written into: a hard link's other names keep their bytes
        write_atomic(out / file, lambda fh, roc=roc: roc.savefig(fh, format="png"))
    print(f"wrote {out / 'metrics.json'} and {wrote}")


# The option naming what is evaluated (its mode) -> the options that belong to that mode alone
# (argparse destinations). One mode per call: --distances, or --checkpoint with one of the
# others (``pairs`` may also come from --config's eval.pairs, and gives way to a mode named on
# the command line).
MODES = {
    "distances": ("similarities",),
    "pairs": ("root", "skip_missing", "show_errors"),
    "bin": (),
    "retrieval": (),
    "ijb": ("ijb_set", "template", "flip_test", "detector_score", "norm_score", "workers"),
}
# How images are embedded: the options of every mode but --distances (a file of distances has
# no model to run).
EMBEDDING = ("flip", "preprocess", "subtract_mean", "features", "scoring", "batch_size", "device")


def _flag(dest: str) -> str:
    """The option a destination is given by (``flip_test``: ``--no-flip-test``)."""
    negated = dest in ("flip_test", "detector_score", "norm_score")
    return "--" + ("no-" if negated else "") + dest.replace("_", "-")


def _given(argv: list[str] | None) -> set[str]:
    """The destinations the command line itself sets (not defaults from --config or --preset)."""
    probe = get_args_parser()
    for action in probe._actions:  # argparse keeps its options there
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv)))


def _choose_mode(args: argparse.Namespace, given: set[str]) -> str:
    """The one mode ``args`` ask for, its options checked against :data:`MODES`."""
    named = [name for name in MODES if name in given]
    chosen = named or (["pairs"] if args.pairs else [])
    if len(chosen) > 1:
        raise DataError(f"{' and '.join(map(_flag, chosen))}: one evaluation at a time")
    if not chosen:  # --distances is a mode, so this is --checkpoint alone
        raise DataError("--checkpoint needs --pairs, --bin, --retrieval or --ijb")
    for name, own in MODES.items():
        for dest in set(own) & given if name != chosen[0] else ():
            raise DataError(f"{_flag(dest)} goes with {_flag(name)}")
    for dest in set(EMBEDDING) & given if chosen[0] == "distances" else ():
        raise DataError(f"{_flag(dest)} goes with --checkpoint: --distances has no model to run")
    return chosen[0]


def _settings_from(known: argparse.Namespace, given: set[str]) -> tuple[str | None, dict]:
    """(where the evaluation settings come from, in words; the defaults they give):
    ``--config`` and ``--preset`` as named, else the defaults; None where a checkpoint's run
    may give them (read after the output checks: :func:`_apply_run_settings`)."""
    named = [f"--{key} {getattr(known, key)}" for key in ("config", "preset") if key in given]
    if known.config:
        return ", ".join(named), config_defaults(known.config)
    if named or not known.checkpoint or known.ijb:  # --ijb: insightface's own settings
        return ", ".join(named) or "the defaults", {}
    return None, {}


def _apply_run_settings(args: argparse.Namespace) -> None:
    """A training checkpoint's run's settings for each not given on the command line, where
    no ``--config`` or ``--preset`` named them; ``args.settings_from`` then says whose."""
    if args.settings_from is not None:
        return
    run = run_settings(args.checkpoint)
    args.settings_from = "the defaults" if run is None else "the run's"
    for key in RUN_FIELDS if run is not None else ():
        if key not in args.given:  # flags on the command line still win
            setattr(args, key, getattr(run.eval, key))


def _folds_from(known: argparse.Namespace, given: set[str], defaults: dict) -> str | None:
    """What set the fold count, when the user did: ``--folds``, or ``--config``'s
    ``eval.n_folds`` when it is not the default; None otherwise."""
    if "n_folds" in given:
        return "--folds"
    if known.config and defaults["n_folds"] != CLASSIC.n_folds:
        return f"--config {known.config}: eval.n_folds"
    return None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with defaults from ``--config`` (or a training checkpoint's run) and then
    ``--preset``; ``args.mode``: the evaluation they ask for; ``args.settings_from``,
    ``args.folds_from`` and ``args.given``: where the settings and the fold count came from
    (``args.folds_of_pairs``: a pairs file's header, once read)."""
    parser = get_args_parser()
    parser.set_defaults(**vars(CLASSIC))  # the settings' defaults are the command's
    known, _ = parser.parse_known_args(argv)
    given = _given(argv)
    settings_from, defaults = _settings_from(known, given)
    parser.set_defaults(**defaults)  # flags on the command line still win
    if known.ijb:  # insightface's networks give raw features; --preset and flags still win
        parser.set_defaults(features="raw")
    if known.preset:  # after --config: the preset names the publisher's whole evaluation
        preset = EVAL_PRESETS[known.preset]
        parser.set_defaults(**{key: getattr(preset, key) for key in PUBLISHER_FIELDS})
    args = parser.parse_args(argv)
    args.mode = _choose_mode(args, given)
    args.given, args.settings_from = given, settings_from
    args.folds_from = _folds_from(known, given, defaults)
    args.folds_of_pairs = False  # until a pairs file's header gives the count
    try:  # the settings check themselves; a refusal names the flag (or --config's key) typed
        VerifySettings.of(args)
    except SettingsError as err:
        raise DataError(err.named(flag_for(err.field))) from None
    return args


def main(argv: list[str] | None = None) -> int:
    """Evaluate; returns the exit code (2: bad input)."""
    return run_command(lambda: _evaluate(_parse(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
