"""Run configuration: YAML files loaded into typed dataclasses.

A configuration has eight sections (data, model, mining, loss, optim, train, eval, logging).
Every key has a default here; a YAML file overrides some of them and ``--set section.key=value``
on the command line overrides the file. Unknown keys, values of the wrong type and unknown
choices are rejected with a :class:`facenet.errors.ConfigError` naming the key, the value, the
file and the valid options. The resolved configuration is written next to the run as
``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from facenet.errors import ConfigError
from facenet.files import write_text_atomic
from facenet.sizes import image_hw

__all__ = [
    "DataConfig",
    "ModelConfig",
    "MiningConfig",
    "LossConfig",
    "OptimConfig",
    "TrainConfig",
    "EvalConfig",
    "LoggingConfig",
    "Config",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "add_override_argument",
    "save_config",
    "RENAMED_KEYS",
]

# facenet.metric.DISTANCE_NAMES, for training and evaluation alike. angular: arccos(cos) / pi,
# davidsandberg/facenet's evaluation distance; seed_l2: the original script's
# sqrt(||x - y||^2 + 1e-4 / D), to reproduce its selection.
Distance = Literal["squared", "euclidean", "cosine", "angular", "seed_l2"]

# Configuration keys renamed (old -> new): the old names are still read, with one warning.
# "held out" is spelled "heldout" everywhere (data.synthetic_heldout_*, the heldout/ folder).
RENAMED_KEYS = {
    "eval.holdout_identities": "eval.heldout_identities",
    "eval.holdout_pairs_per_fold": "eval.heldout_pairs_per_fold",
}


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


@dataclass
class DataConfig:
    """Where images come from and how batches are formed."""

    # synthetic: built-in SyntheticIdentities written to disk; folder: root/<identity>/<image>;
    # triplets: seed-compatible (anchor, positive, negative) batches from a TripletListDataset.
    dataset: Literal["synthetic", "folder", "triplets"] = "synthetic"
    root: str | None = None  # image folder; for synthetic, where it is generated
    # the network's input: S (S x S) or [H, W] (e.g. [112, 96], MobileFaceNet's SphereFace crops)
    image_size: int | list[int] = 64
    p: int = 16  # identities per batch
    k: int = 4  # images per identity
    triplets_per_epoch: int = 10000  # seed-compatible mode only
    triplet_batch_size: int = 64  # seed-compatible mode: triplets per batch
    # auto: from the machine (facenet.data.loading.default_num_workers / default_pin_memory):
    # a worker per core the step leaves free; pinned memory when training on a GPU.
    num_workers: int | Literal["auto"] = "auto"
    pin_memory: bool | Literal["auto"] = "auto"
    # Decoded uint8 training images kept in memory, at most this many MiB over all workers
    # (0: decode every time); small data sets are then decoded once.
    decoded_cache_mib: int = 1024
    normalize: Literal["fixed", "imagenet"] = "fixed"  # fixed: (x - 127.5) / 128
    hflip: bool = True
    random_crop: bool = True
    on_corrupt: Literal["skip", "error"] = "skip"
    sample_with_replacement: bool = True  # identities with < k images
    cache_dir: str | None = None
    # Images whose header declares more pixels, or a longer side / shorter side above this,
    # are refused before decoding (treated as corrupt: see on_corrupt).
    max_image_pixels: int = 64_000_000
    max_aspect_ratio: float = 20.0
    # SyntheticIdentities (dataset: synthetic)
    synthetic_identities: int = 60
    synthetic_images_per_identity: int = 20
    synthetic_heldout_identities: int = 40
    synthetic_heldout_images_per_identity: int = 10
    synthetic_pairs_per_fold: int = 60  # same and different pairs, each, per fold
    synthetic_seed: int = 0


@dataclass
class ModelConfig:
    """The embedding network."""

    backbone: Literal[
        "tiny",
        "resnet18",
        "resnet34",
        "resnet50",
        "mobilenet_v3_large",
        "inception_resnet_v1",
        "mobilefacenet",
    ] = "tiny"
    embedding_dim: int = 128
    dropout: float = 0.0
    weights: str | None = None  # a local state-dict file for the backbone; never downloaded
    # Also start the embedding head from model.weights (a facenet-pytorch file's last_linear and
    # last_bn, or an EmbeddingNet's embedding.*): fine-tuning a published model, head included.
    weights_head: bool = False
    channels_last: bool = False


@dataclass
class MiningConfig:
    """Triplet selection."""

    miner: Literal["semihard", "batch_hard", "triplet_margin"] = "semihard"
    type_of_triplets: Literal["all", "hard", "semihard", "easy"] = "semihard"
    margin: float = 0.2
    distance: Distance = "squared"
    fallback: Literal["hardest", "skip"] = "hardest"
    max_triplets: int = 0  # 0: no cap
    strict_margin: bool = False  # triplet_margin: d(a,n) - d(a,p) < margin, as the seed filtered
    # auto: one grad pass when the miner selects every image (batch_hard; semihard with
    # fallback: hardest and no max_triplets), two passes (no-grad mining pass + grad pass on
    # the selected images) when selection is sparse (triplet lists, max_triplets, fallback:
    # skip, the triplet_margin miner), chunked when train.chunk_size > 0.
    passes: Literal["auto", 1, 2] = "auto"


@dataclass
class LossConfig:
    """Triplet loss, plus optional cross-entropy from the same forward."""

    margin: float = 0.2
    distance: Distance = "squared"
    reduction: Literal["mean_active", "mean", "sum"] = "mean_active"
    soft_margin: bool = False
    swap: bool = False
    ce_weight: float = 0.0  # > 0 adds a classifier head and weight x cross-entropy


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Literal["sgd", "adam", "adamw", "adagrad"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    # Stepped once per training step (skipped ones included); each parameter group's rate is
    # its own starting rate times the schedule's factor (facenet.training.optim).
    schedule: Literal["cosine", "step", "none"] = "cosine"
    # Linear warm-up (cosine and step) over warmup_steps steps, or warmup_epochs epochs
    # converted to steps; one of the two.
    warmup_epochs: int = 0
    warmup_steps: int = 0
    step_size: int = 10  # epochs, for schedule: step (after warm-up; exact epoch boundaries)
    gamma: float = 0.1
    min_lr_ratio: float = 0.01  # cosine's floor, a fraction of each group's starting rate
    grad_clip: float = 0.0  # 0: off
    # Fine-tuning: the backbone's learning rate is lr x backbone_lr_scale; for the first
    # freeze_backbone_epochs epochs the backbone (or its stages up to and including the one
    # named by freeze_up_to) has learning rate 0.
    backbone_lr_scale: float = 1.0
    freeze_backbone_epochs: int = 0
    freeze_up_to: str | None = None


@dataclass
class TrainConfig:
    """The loop."""

    epochs: int = 10
    steps_per_epoch: int = 0  # 0: a full pass of the sampler
    device: Literal["auto", "cpu", "cuda"] = "auto"
    amp: Literal["none", "bf16", "fp16"] = "none"
    seed: int = 0
    deterministic: bool = False
    log_interval: int = 10
    max_nonfinite_steps: int = 5
    chunk_size: int = 0  # gradient caching: grad pass in chunks of N images; 0 = off


@dataclass
class EvalConfig:
    """Verification on held-out pairs (the LFW protocol)."""

    # Validation pairs choose best.pt (and the threshold) every `every` epochs; test pairs are
    # evaluated once, at the end, for best.pt and the last model. Identity-disjoint sets.
    every: int = 1  # epochs; 0 = never
    val_pairs: str | None = None  # validation pairs; None: the synthetic or held-out ones
    val_root: str | None = None  # image folder the validation pairs name; None: next to them
    pairs: str | None = None  # test pairs (e.g. LFW's pairs.txt); None: synthetic or held-out
    root: str | None = None  # image folder the test pairs name; None: next to pairs.txt
    # folder data without pairs files: hold out this many identities (never trained on), half
    # for validation, half for test; their pairs files are written into the run directory.
    heldout_identities: int = 0
    heldout_pairs_per_fold: int = 50
    n_folds: int = 10
    far_target: float = 1e-3
    distance: Distance = "squared"
    # evaluation transform: "resize" (1.125 S, centre S: this project's training convention) or
    # "crop" (no resize: centre crop or zero-pad to S, as both publishers feed aligned crops)
    preprocess: Literal["resize", "crop"] = "resize"
    # threshold grids: "default" (from the distance) or "classic" ([0, 4) in steps of 0.01 and
    # 0.001 for every distance, as davidsandberg/facenet and facenet-pytorch's LFW code did)
    # "mobilefacenet": Xiaoccer/MobileFaceNet_Pytorch's cosine similarities in steps of 1e-4
    grid: Literal["default", "classic", "mobilefacenet"] = "default"
    flip: bool = False
    subtract_mean: bool = False
    # "unit": the network's unit embeddings; "raw": before L2 normalisation (MobileFaceNet_Pytorch)
    features: Literal["unit", "raw"] = "unit"
    # each fold's threshold: "first" best on the training folds (classic) or "mean" of every
    # best one, a tie at it wrong for either kind (MobileFaceNet_Pytorch's lfw_eval.py)
    threshold_rule: Literal["first", "mean"] = "first"
    # "float64": the distance in float64; "mobilefacenet": lfw_eval.py's cosine in float32
    scoring: Literal["float64", "mobilefacenet"] = "float64"
    batch_size: int = 128
    skip_missing: bool = False
    log_scale_roc: bool = True  # logarithmic FAR axis (the low-FAR end is what VAL reads)


@dataclass
class LoggingConfig:
    """Where the run is written and what is shown."""

    out_dir: str = "runs/demo"
    tensorboard: bool = True
    progress: bool = True
    # Count the bytes autograd saves for backward each step; opt-in, it costs a hook per saved
    # tensor.
    graph_memory: bool = False


@dataclass
class Config:
    """A whole run configuration."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mining: MiningConfig = field(default_factory=MiningConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --------------------------------------------------------------------------- validation

_INT_MAX = 2**31 - 1  # counts and sizes; larger values overflow somewhere downstream


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: low..high, each end open or closed."""

    low: float
    high: float = _INT_MAX
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(value: float) -> str:
    """``2147483647`` rather than ``2.14748e+09``; ``inf`` and fractions as floats."""
    return str(int(value)) if math.isfinite(value) and value == int(value) else f"{value:g}"


_COUNT, _POSITIVE, _ONE_PLUS, _TWO_PLUS = Range(0), Range(0, math.inf, True), Range(1), Range(2)
_NON_NEGATIVE, _FRACTION = Range(0, math.inf), Range(0, 1, False, True)

# Every int and float key: the range it accepts (tests/test_config.py checks none is missing).
RANGES: dict[str, Range] = {
    "data.image_size": Range(8, 4096),
    "data.p": _TWO_PLUS,  # negatives need two identities
    "data.k": _TWO_PLUS,  # positives need two images
    "data.triplets_per_epoch": _ONE_PLUS,
    "data.triplet_batch_size": _ONE_PLUS,
    "data.num_workers": Range(0, 1024),
    "data.decoded_cache_mib": _COUNT,
    "data.max_image_pixels": _ONE_PLUS,
    "data.max_aspect_ratio": Range(1, math.inf),
    "data.synthetic_identities": _TWO_PLUS,
    "data.synthetic_images_per_identity": _TWO_PLUS,
    "data.synthetic_heldout_identities": _TWO_PLUS,
    "data.synthetic_heldout_images_per_identity": _TWO_PLUS,
    "data.synthetic_pairs_per_fold": _ONE_PLUS,
    "data.synthetic_seed": Range(0, 2**63 - 1),
    "model.embedding_dim": Range(1, 65536),
    "model.dropout": _FRACTION,
    "mining.margin": _NON_NEGATIVE,
    "mining.max_triplets": _COUNT,
    "loss.margin": _NON_NEGATIVE,
    "loss.ce_weight": _NON_NEGATIVE,
    "optim.lr": _POSITIVE,
    "optim.weight_decay": _NON_NEGATIVE,
    "optim.momentum": _FRACTION,
    "optim.warmup_epochs": _COUNT,
    "optim.warmup_steps": _COUNT,
    "optim.min_lr_ratio": Range(0, 1),
    "optim.step_size": _ONE_PLUS,
    "optim.gamma": Range(0, math.inf, True),
    "optim.grad_clip": _NON_NEGATIVE,
    "optim.backbone_lr_scale": _NON_NEGATIVE,
    "optim.freeze_backbone_epochs": _COUNT,
    "train.epochs": _ONE_PLUS,  # zero epochs would train on nothing
    "train.steps_per_epoch": _COUNT,  # 0: a full pass of the sampler
    "train.seed": Range(0, 2**63 - 1),
    "train.log_interval": _ONE_PLUS,
    "train.max_nonfinite_steps": _ONE_PLUS,
    "train.chunk_size": _COUNT,  # < 0 and 1 are refused with the reason in _check_combinations
    "eval.every": _COUNT,  # 0: never
    "eval.heldout_identities": _COUNT,
    "eval.heldout_pairs_per_fold": _ONE_PLUS,
    "eval.n_folds": Range(2, 1000),  # a fold's threshold is chosen on the others
    "eval.far_target": Range(0, 1, True),
    "eval.batch_size": _ONE_PLUS,
}


def _check_ranges(cfg: Config, source: str) -> None:
    """Refuse a numeric value outside its key's range, naming the key and the range; a list
    value (``data.image_size: [H, W]``) has each element checked."""
    for dotted, allowed in RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key, None)
        for element in value if isinstance(value, list) else [value]:
            if isinstance(element, (int, float)) and element not in allowed:
                what = f"{value!r}" if element is value else f"{value!r}: side {element!r}"
                raise ConfigError(f"{source}: {dotted}: {what} is out of range; allowed: {allowed}")


def _check_image_size(cfg: Config, source: str) -> None:
    """``data.image_size``: one side or exactly [H, W] (the list type admits any length)."""
    try:
        image_hw(cfg.data.image_size)
    except ValueError:
        raise ConfigError(
            f"{source}: data.image_size: {cfg.data.image_size!r}: expected one int (a square "
            "input) or [height, width]"
        ) from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        # bool is an int subclass: never let True stand for 1.
        if not isinstance(value, bool) and value in choices:
            return value
        raise ConfigError(
            f"{where}: invalid value {value!r}; valid options: "
            + ", ".join(repr(c) for c in choices)
        )
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {value!r} is not {_type_name(tp)}")
    if origin is list:
        if isinstance(value, (list, tuple)):
            return [_coerce(v, typing.get_args(tp)[0], where) for v in value]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-3 (no dot) as a string; accept what is plainly a number.
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a new annotation kind must be taught here
        raise TypeError(f"unsupported config annotation {tp!r} at {where}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _section_from_dict(cls: type, values: Any, section: str, source: str) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in _rename_old_keys(values, section, source).items():
        if key not in hints:
            raise ConfigError(
                f"{source}: unknown key '{section}.{key}'; valid keys in '{section}': "
                + ", ".join(names)
            )
        kwargs[key] = _coerce(value, hints[key], f"{source}: {section}.{key}")
    return cls(**kwargs)


def _new_key_name(section: str, key: str, source: str) -> str:
    """The current name of ``section.key``; an old name is accepted with one warning."""
    new = RENAMED_KEYS.get(f"{section}.{key}")
    if new is None:
        return key
    warnings.warn(f"{source}: {section}.{key} is now {new}; please rename it", stacklevel=4)
    return new.split(".", 1)[1]


def _rename_old_keys(values: dict, section: str, source: str) -> dict:
    """``values`` with renamed keys under their new names (both spellings at once: an error)."""
    renamed = {}
    for key, value in values.items():
        new = _new_key_name(section, key, source)
        if new in renamed or (new != key and new in values):
            raise ConfigError(f"{source}: {section}.{key} and {section}.{new} are the same key")
        renamed[new] = value
    return renamed


def config_from_dict(data: Any, source: str = "<dict>") -> Config:
    """Build a :class:`Config` from a nested mapping, validating every key and value.

    Args:
        data: ``{section: {key: value}}``; missing sections and keys take their defaults.
        source: the file name (or a description) quoted in error messages.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a configuration must be a mapping of sections, got {data!r}")
    hints = typing.get_type_hints(Config)
    sections = {}
    for name, values in data.items():
        if name not in hints:
            raise ConfigError(
                f"{source}: unknown section '{name}'; valid sections: " + ", ".join(hints)
            )
        sections[name] = _section_from_dict(hints[name], values, name, source)
    cfg = Config(**sections)
    _check_combinations(cfg, source)  # first: its messages say why (train.chunk_size: 1)
    _check_image_size(cfg, source)
    _check_ranges(cfg, source)
    return cfg


def _check_combinations(cfg: Config, source: str) -> None:
    """Reject values that no run can use, and keys whose values are valid alone but not
    together."""
    if cfg.train.chunk_size < 0 or cfg.train.chunk_size == 1:
        raise ConfigError(
            f"{source}: train.chunk_size: {cfg.train.chunk_size}; 0 (off) or at least 2: each "
            "chunk is a BatchNorm batch, and BatchNorm needs two images"
        )
    if cfg.optim.warmup_epochs > 0 and cfg.optim.warmup_steps > 0:
        raise ConfigError(
            f"{source}: optim.warmup_steps: {cfg.optim.warmup_steps} and optim.warmup_epochs: "
            f"{cfg.optim.warmup_epochs}: give the warm-up's length once (the other 0)"
        )
    if cfg.mining.passes == 1 and cfg.train.chunk_size > 0:
        raise ConfigError(
            f"{source}: mining.passes: 1 cannot be used with train.chunk_size: "
            f"{cfg.train.chunk_size}; chunked steps are two-pass (use mining.passes: 2 or auto)"
        )


def config_to_dict(cfg: Config) -> dict:
    """The configuration as a plain nested dict (YAML- and checkpoint-safe)."""
    return dataclasses.asdict(cfg)


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {item!r}: value is not a YAML scalar ({err})") from None
    # A list is a value of its own for the list-typed keys (data.image_size=[112,96]); the
    # key's type refuses it anywhere else.
    if isinstance(value, dict):
        raise ConfigError(f"--set {item!r}: value must be a scalar or a list")
    return parts[0], parts[1], value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply ``section.key=value`` strings (values parsed as YAML scalars, or a list such as
    ``data.image_size=[112,96]``) to a nested dict.

    Args:
        data: ``{section: {key: value}}`` as read from a file (not modified).
        overrides: the ``--set`` strings, in order.
    """
    data = {k: dict(v or {}) for k, v in (data or {}).items()}
    for item in overrides or []:
        section, key, value = _parse_override(item)
        key = _new_key_name(section, key, f"--set {item}")
        values = data.setdefault(section, {})
        for old, new in RENAMED_KEYS.items():  # the override replaces the file's old spelling
            if new == f"{section}.{key}":
                values.pop(old.split(".", 1)[1], None)
        values[key] = value
    return data


def add_override_argument(parser) -> None:
    """Add the repeatable ``--set section.key=value`` option (to ``args.overrides``).

    Args:
        parser: an ``argparse.ArgumentParser``.
    """
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=(
            "override one key (value parsed as YAML, e.g. data.image_size=32 or "
            "data.image_size=[112,96]); repeatable"
        ),
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (YAML keeps the last
    one silently, so a repeated section would drop the first one's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_config_text(path: str | os.PathLike) -> str:
    """The text of a config file; only a regular file is read (a FIFO would block)."""
    source = str(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"config file {source} is not a regular file")
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {source} is not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {source}: {err.strerror}") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML run configuration and apply command-line overrides.

    Args:
        path: the YAML file; None for the defaults alone.
        overrides: ``["section.key=value", ...]``, applied after the file.

    Raises:
        ConfigError: a missing, unreadable or special file, invalid YAML (``!!python`` tags
            and duplicate keys included), an unknown section or key, a value of the wrong type,
            out of its range (the message gives the range) or an unknown choice.
    """
    data: Any = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        text = _read_config_text(path)
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # safe_load, duplicates refused
        except yaml.YAMLError as err:
            raise ConfigError(f"{source}: invalid YAML: {err}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: a configuration must be a mapping of sections")
        for name, values in data.items():
            if values is not None and not isinstance(values, dict):
                raise ConfigError(f"{source}: section '{name}' must be a mapping, got {values!r}")
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} with --set overrides"
    return config_from_dict(data, source)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved configuration as YAML, atomically (``files.write_text_atomic``)."""
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
