"""Run configuration: YAML files loaded into typed dataclasses.

Every key has a default here; a YAML file overrides some of them and ``--set section.key=value``
overrides the file. Unknown keys, wrong types, unknown choices and numbers outside their
:data:`RANGES` are refused with a :class:`facenet.errors.ConfigError` naming the key, the value,
the file and the valid options; the ``eval`` section's verification settings are checked by
``VerifySettings`` itself, its refusal renamed to the key. The resolved configuration is written
beside the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import yaml

from facenet.errors import ConfigError, shown
from facenet.evaluation.presets import SettingsError, VerifySettings
from facenet.files import open_regular, write_text_atomic
from facenet.sizes import image_hw

# facenet.metric.distances.DISTANCE_NAMES, described there.
Distance = Literal["squared", "euclidean", "cosine", "angular", "seed_l2"]

# Old key -> new key: the old name is still read, with one warning.
RENAMED_KEYS = {
    "eval.holdout_identities": "eval.heldout_identities",
    "eval.holdout_pairs_per_fold": "eval.heldout_pairs_per_fold",
}

_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
# A configuration is two levels deep and small: bounds that no real one reaches, so that a
# crafted document (a deep nest, an alias bomb, a 5000-digit integer) is refused while parsed.
_MAX_DEPTH, _MAX_NODES, _MAX_DIGITS = 16, 10_000, 30


@dataclass
class DataConfig:
    # synthetic: generated under root; folder: root/<identity>/<image>; triplets: the seed
    # script's (anchor, positive, negative) batches from a TripletListDataset.
    dataset: Literal["synthetic", "folder", "triplets", "recordio"] = "synthetic"
    root: str | None = None
    image_size: int | list[int] = 64  # S (S x S) or [H, W], e.g. [112, 96] for MobileFaceNet
    p: int = 16  # identities per batch
    k: int = 4  # images per identity
    triplets_per_epoch: int = 10000  # dataset: triplets
    triplet_batch_size: int = 64  # dataset: triplets
    # auto: a worker per core the step leaves free; pinned memory when training on a GPU.
    num_workers: int | Literal["auto"] = "auto"
    pin_memory: bool | Literal["auto"] = "auto"
    decoded_cache_mib: int = 1024  # decoded images kept, over all workers; 0: decode every time
    normalize: Literal["fixed", "imagenet"] = "fixed"  # fixed: (x - 127.5) / 128
    hflip: bool = True
    random_crop: bool = True
    on_corrupt: Literal["skip", "error"] = "skip"
    sample_with_replacement: bool = True  # identities with < k images
    cache_dir: str | None = None
    # Larger headers are refused before decoding, as corrupt (see on_corrupt).
    max_image_pixels: int = 64_000_000
    max_aspect_ratio: float = 20.0
    synthetic_identities: int = 60
    synthetic_images_per_identity: int = 20
    synthetic_heldout_identities: int = 40
    synthetic_heldout_images_per_identity: int = 10
    synthetic_pairs_per_fold: int = 60  # same and different pairs, each, per fold
    synthetic_seed: int = 0


@dataclass
class ModelConfig:
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
    # Also the embedding head from model.weights (facenet-pytorch's last_linear and last_bn, or
    # an EmbeddingNet's embedding.*).
    weights_head: bool = False
    channels_last: bool = False


@dataclass
class MiningConfig:
    miner: Literal["semihard", "batch_hard", "triplet_margin"] = "semihard"
    type_of_triplets: Literal["all", "hard", "semihard", "easy"] = "semihard"
    margin: float = 0.2
    distance: Distance = "squared"
    fallback: Literal["hardest", "skip"] = "hardest"
    max_triplets: int = 0  # 0: no cap
    strict_margin: bool = False  # triplet_margin: d(a,n) - d(a,p) < margin, as the seed filtered
    # auto: one grad pass when the miner selects every image, else a no-grad mining pass and a
    # grad pass on the selected images (chunked when train.chunk_size > 0).
    passes: Literal["auto", 1, 2] = "auto"


@dataclass
class LossConfig:
    margin: float = 0.2
    distance: Distance = "squared"
    reduction: Literal["mean_active", "mean", "sum"] = "mean_active"
    soft_margin: bool = False
    swap: bool = False
    ce_weight: float = 0.0  # > 0 adds a classifier head and weight x cross-entropy
    # softmax: a linear classifier on the prelogits; cosface, arcface: a cosine classifier
    # (unit weights and embeddings), its target's logit given a margin, all logits x ce_scale.
    ce: Literal["softmax", "cosface", "arcface"] = "softmax"
    ce_scale: float = 64.0
    ce_margin: float | None = None  # None: 0.35 cosface, 0.5 arcface (radians)


@dataclass
class OptimConfig:
    name: Literal["sgd", "adam", "adamw", "adagrad"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    # Stepped every training step; each group's rate is its starting rate x the schedule.
    schedule: Literal["cosine", "step", "none"] = "cosine"
    warmup_epochs: int = 0  # linear warm-up; give epochs or steps, not both
    warmup_steps: int = 0
    step_size: int = 10  # epochs, for schedule: step
    gamma: float = 0.1
    min_lr_ratio: float = 0.01  # cosine's floor, a fraction of each group's starting rate
    grad_clip: float = 0.0  # 0: off
    # Fine-tuning: the backbone learns at lr x backbone_lr_scale, and not at all for the first
    # freeze_backbone_epochs epochs ("all": the whole run) (only its stages up to freeze_up_to,
    # if named: a stage, or an element of a sequential stage such as blocks.9).
    backbone_lr_scale: float = 1.0
    freeze_backbone_epochs: int | Literal["all"] = 0
    freeze_up_to: str | None = None
    # BatchNorm in training: adapt (batch statistics, running ones follow the data); frozen:
    # eval mode (the running statistics used and kept), for every layer or the frozen stages'.
    bn: Literal["adapt", "frozen_stages", "frozen"] = "adapt"


@dataclass
class TrainConfig:
    epochs: int = 10
    steps_per_epoch: int = 0  # 0: a full pass of the sampler
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = 1  # torch CPU threads; 0: torch's default (one per core)
    amp: Literal["none", "bf16", "fp16"] = "none"
    seed: int = 0
    deterministic: bool = False
    log_interval: int = 10
    max_nonfinite_steps: int = 5
    chunk_size: int = 0  # gradient caching: grad pass in chunks of N images; 0 = off
    # How long a rank waits in a collective (a barrier included) before the run fails: rank 0
    # builds a large folder's index while the others wait.
    dist_timeout_minutes: float = 30.0
    # The frozen stages' outputs computed once per image (and its mirror) and trained on.
    cache_frozen: bool = False


@dataclass
class EvalConfig:
    # Validation pairs choose best.pt and the threshold every `every` epochs (0: never); test
    # pairs are evaluated once at the end. None: the synthetic or held-out pairs.
    every: int = 1
    patience: int = 0  # evaluations without a better validation accuracy that stop; 0: off
    val_pairs: str | None = None
    val_root: str | None = None  # None: the folder of val_pairs
    pairs: str | None = None  # e.g. LFW's pairs.txt
    root: str | None = None  # None: the folder of pairs
    # Folder data without pairs files: identities never trained on, half for validation, half
    # for test; their pairs files are written into the run directory.
    heldout_identities: int = 0
    heldout_pairs_per_fold: int = 50
    # The verification settings: facenet.evaluation.presets.VerifySettings checks their values.
    n_folds: int = 10  # at least 2
    far_target: float = 1e-3  # in (0, 1]
    distance: str = "squared"  # as mining.distance
    # resize: 1.125 S then centre S (as trained); crop: centre crop or pad to S (aligned crops)
    preprocess: str = "resize"
    # default: from the distance; classic: [0, 4) in steps of 0.01 and 0.001 (davidsandberg and
    # facenet-pytorch); mobilefacenet: MobileFaceNet_Pytorch's cosines in steps of 1e-4
    grid: str = "default"
    flip: bool = False
    subtract_mean: bool = False
    features: str = "unit"  # unit; raw: before L2 normalisation
    # first: the best threshold on the training folds (classic); mean: of every best one
    # (MobileFaceNet_Pytorch's lfw_eval.py)
    threshold_rule: str = "first"
    scoring: str = "float64"  # float64; mobilefacenet: its cosine in float32
    batch_size: int = 128
    skip_missing: bool = False
    log_scale_roc: bool = True


@dataclass
class LoggingConfig:
    out_dir: str = "runs/demo"
    tensorboard: bool = True
    progress: bool = True
    graph_memory: bool = False  # count the bytes autograd saves each step (a hook per tensor)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mining: MiningConfig = field(default_factory=MiningConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass(frozen=True)
class StepSettings:
    """How the training step runs, checked here for every caller (a configuration's message
    names the keys, mining.passes and train.chunk_size). ``passes``: "auto", 1 or 2 (see
    ``facenet.training.step.choose_step``); ``chunk_size``: images per chunk of gradient
    caching, 0 (off) or at least 2; ``triplet_lists``: seed-style (a, p, n) batches;
    ``ce_weight``: the cross-entropy's weight (0: none); ``amp``: "none", "bf16" or "fp16"."""

    passes: int | str = "auto"
    chunk_size: int = 0
    triplet_lists: bool = False
    ce_weight: float = 0.0
    amp: str = "none"

    def __post_init__(self):
        if isinstance(self.passes, bool) or self.passes not in ("auto", 1, 2):
            raise ConfigError(f"passes: {shown(self.passes)}; allowed: 'auto', 1 or 2")
        if type(self.chunk_size) is not int or self.chunk_size < 0 or self.chunk_size == 1:
            raise ConfigError(
                f"chunk_size: {shown(self.chunk_size)}; 0 (off) or at least 2: each chunk is a "
                "BatchNorm batch, and BatchNorm needs two images"
            )
        if self.passes == 1 and self.chunk_size > 0:
            raise ConfigError(
                f"passes: 1 cannot be used with chunk_size: {self.chunk_size}; chunked steps "
                "are two-pass (use passes: 2 or auto)"
            )


_SECTIONS = typing.get_type_hints(Config)
_HINTS = {name: typing.get_type_hints(section) for name, section in _SECTIONS.items()}


_INT_MAX = 2**31 - 1  # counts and sizes; larger values overflow somewhere downstream


@dataclass(frozen=True)
class Range:
    """The values a number accepts: low..high, each end open or closed; never NaN or inf."""

    low: float
    high: float = _INT_MAX
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return -math.inf < value < math.inf and above and below  # NaN: False; ints exact

    def __str__(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{self.low}, {self.high}{right}"


def max_threads() -> int:
    """The most torch CPU threads a run or command may ask for: 4 per CPU core. Each thread takes
    a stack and a share of the allocator's arenas, so 1,024 under a memory limit ended in
    ``std::bad_alloc``, not a line (``train.threads`` and every ``--threads`` use this bound)."""
    return 4 * (os.cpu_count() or 1)


# Every int and float key, by the range it accepts, but the eval section's verification settings
# (VerifySettings checks those; tests/test_config.py checks that none is missing). p and k are at
# least 2: negatives need two identities, positives two images; train.chunk_size 1 is refused by
# StepSettings, with the reason; zero epochs would train on nothing.
RANGES: dict[str, Range] = {
    key: allowed
    for allowed, keys in {
        Range(0): "data.decoded_cache_mib mining.max_triplets optim.warmup_epochs "
        "optim.warmup_steps optim.freeze_backbone_epochs train.steps_per_epoch train.chunk_size "
        "eval.every eval.heldout_identities eval.patience",
        Range(1): "data.triplets_per_epoch data.triplet_batch_size data.max_image_pixels "
        "data.synthetic_pairs_per_fold optim.step_size train.epochs train.log_interval "
        "train.max_nonfinite_steps eval.heldout_pairs_per_fold",
        Range(2): "data.p data.k",
        # The generator keeps a label and a file name per image and renders each: at most 10^8
        # images (MS1M holds 5.8 million; 10^8 PNGs of 64 px are about 1 TB), past any demo.
        Range(2, 100_000): "data.synthetic_identities data.synthetic_heldout_identities",
        Range(2, 1_000): "data.synthetic_images_per_identity "
        "data.synthetic_heldout_images_per_identity",
        Range(0, math.inf): "mining.margin loss.margin loss.ce_weight optim.weight_decay "
        "optim.grad_clip optim.backbone_lr_scale",
        Range(0, math.inf, True): "optim.lr optim.gamma loss.ce_scale",
        Range(0, 7 * 24 * 60, True): "train.dist_timeout_minutes",  # a week: timedelta's range
        Range(0, math.pi, False, True): "loss.ce_margin",
        Range(0, 1, False, True): "model.dropout optim.momentum",
        Range(0, 1): "optim.min_lr_ratio",
        Range(0, 2**63 - 1): "data.synthetic_seed train.seed",
        Range(1, math.inf): "data.max_aspect_ratio",
        Range(8, 4096): "data.image_size",
        Range(0, 1024): "data.num_workers",
        Range(0, max_threads()): "train.threads",
        Range(1, 65536): "model.embedding_dim",
    }.items()
    for key in keys.split()
}


def _check_values(cfg: Config, source: str) -> None:
    """Refuse combinations no run can use, a malformed image size, numbers out of range and
    verification settings ``VerifySettings`` refuses (named by their keys)."""
    try:
        StepSettings(cfg.mining.passes, cfg.train.chunk_size)
    except ConfigError as err:  # its message names its fields: the keys the user typed
        named = str(err).replace("passes:", "mining.passes:")
        named = named.replace("chunk_size:", "train.chunk_size:")
        raise ConfigError(f"{source}: {named}") from None
    if cfg.optim.warmup_epochs > 0 and cfg.optim.warmup_steps > 0:
        raise ConfigError(
            f"{source}: optim.warmup_steps: {cfg.optim.warmup_steps} and optim.warmup_epochs: "
            f"{cfg.optim.warmup_epochs}: give the warm-up's length once (the other 0)"
        )
    try:
        image_hw(cfg.data.image_size)  # the list type admits any length
    except ValueError:
        raise ConfigError(
            f"{source}: data.image_size: {shown(cfg.data.image_size)}: expected one int "
            "(a square input) or [height, width]"
        ) from None
    for dotted, allowed in RANGES.items():
        value = operator.attrgetter(dotted)(cfg)
        for element in value if isinstance(value, list) else [value]:
            if isinstance(element, (int, float)) and element not in allowed:
                what = shown(value) + ("" if element is value else f": side {shown(element)}")
                raise ConfigError(f"{source}: {dotted}: {what} is out of range; allowed: {allowed}")
    try:
        VerifySettings.of(cfg.eval)
    except SettingsError as err:
        raise ConfigError(f"{source}: {err.named('eval.' + err.field)}") from None


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, args))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(args[0])}"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(map(_type_name, args))
    return "null" if tp is type(None) else tp.__name__


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against the annotation ``tp`` (ints widen to floats)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if not isinstance(value, bool) and value in args:  # True must not stand for 1
            return value
        raise ConfigError(
            f"{where}: invalid value {shown(value)}; valid options: " + ", ".join(map(repr, args))
        )
    if origin in (Union, types.UnionType):
        for arg in args:
            with contextlib.suppress(ConfigError):
                return _coerce(value, arg, where)
        raise ConfigError(f"{where}: {shown(value)} is not {_type_name(tp)}")
    if origin is list and isinstance(value, (list, tuple)):
        return [_coerce(v, args[0], where) for v in value]
    # YAML 1.1 reads 1e-3 (no dot) as a string; accept what is plainly a number.
    if tp is float and isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        return float(value)
    accepted = {bool: bool, int: int, float: (int, float), str: str, type(None): tp}.get(tp, ())
    if isinstance(value, accepted) and (tp is bool or not isinstance(value, bool)):
        return float(value) if tp is float else value
    raise ConfigError(
        f"{where}: expected {_type_name(tp)}, got {shown(value)} ({type(value).__name__})"
    )


def _current_key(section: str, key: str, source: str) -> str:
    """The current name of ``section.key``; an old name is read with one warning."""
    new = RENAMED_KEYS.get(f"{section}.{key}")
    if new is None:
        return key
    warnings.warn(f"{source}: {section}.{key} is now {new}; please rename it", stacklevel=4)
    return new.split(".", 1)[1]


def _sections(data: Any, source: str) -> dict[str, dict]:
    """``{section: {key: value}}`` copied from a parsed file, old key names replaced by the
    current ones, or a ConfigError saying why not."""
    if not isinstance(data, (dict, type(None))):
        raise ConfigError(
            f"{source}: a configuration must be a mapping of sections, got {shown(data)}"
        )
    sections = {}
    for name, values in (data or {}).items():
        if name not in _HINTS:
            raise ConfigError(
                f"{source}: unknown section '{name}'; valid sections: " + ", ".join(_HINTS)
            )
        if not isinstance(values, (dict, type(None))):
            raise ConfigError(f"{source}: section '{name}' must be a mapping, got {shown(values)}")
        sections[name] = renamed = {}
        for old_key, value in (values or {}).items():
            key = _current_key(name, old_key, source)
            if key != old_key and key in values:  # either order
                raise ConfigError(f"{source}: {name}.{old_key} and {name}.{key} are the same key")
            renamed[key] = value
    return sections


def config_from_dict(data: Any, source: str = "<dict>") -> Config:
    """A checked :class:`Config` from ``{section: {key: value}}`` (missing keys: defaults);
    ``source`` names the file in messages."""
    cfg = Config()
    for name, values in _sections(data, source).items():
        for key, value in values.items():
            if key not in _HINTS[name]:
                raise ConfigError(
                    f"{source}: unknown key '{name}.{key}'; valid keys in '{name}': "
                    + ", ".join(_HINTS[name])
                )
            value = _coerce(value, _HINTS[name][key], f"{source}: {name}.{key}")
            setattr(getattr(cfg, name), key, value)
    _check_values(cfg, source)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """The configuration as a plain nested dict (YAML- and checkpoint-safe)."""
    return dataclasses.asdict(cfg)


def _apply_overrides(data: dict[str, dict], overrides: list[str]) -> None:
    """Set each ``section.key=value`` (the value parsed as YAML) in ``data``, in place."""
    for item in overrides:
        dotted, equals, raw = item.partition("=")
        parts = dotted.strip().split(".")
        if not equals or len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {shown(item)}: expected section.key=value")
        try:
            value = _parse_yaml(raw)  # "" is None; a list, a value for list keys ([112,96])
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {shown(item)}: value is not a YAML scalar ({err})") from None
        data.setdefault(parts[0], {})[_current_key(*parts, f"--set {item}")] = value


def add_override_argument(parser) -> None:
    """Add the repeatable ``--set section.key=value`` option (to ``args.overrides``)."""
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


def _refused(problem: str, mark) -> yaml.YAMLError:
    return yaml.constructor.ConstructorError(None, None, problem, mark)


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` refusing repeated keys (YAML would keep the last one silently), keys
    that are lists or mappings, and integers longer than ``_MAX_DIGITS``."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base": SafeLoader merges it
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise _refused(
                    "a key must be a plain value, not a list or mapping", key_node.start_mark
                )
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _refused(f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        if len(node.value) > _MAX_DIGITS:
            raise _refused(f"an integer of {len(node.value)} characters", node.start_mark)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _parse_yaml(text: str) -> Any:
    """``text`` loaded once its events show at most ``_MAX_DEPTH`` levels and ``_MAX_NODES``
    values, each alias counted as the values it repeats (a YAMLError otherwise)."""
    total, sizes, open_collections = 0, {}, []  # sizes: anchor -> its values
    for event in yaml.parse(text, Loader=_BoundedLoader):
        if isinstance(event, yaml.AliasEvent):
            total += sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.NodeEvent):
            total += 1
            if isinstance(event, yaml.CollectionStartEvent):
                open_collections.append((event.anchor, total))
            else:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_collections.pop()
            sizes[anchor] = total - start + 1
        if len(open_collections) > _MAX_DEPTH:
            raise _refused(f"nested more than {_MAX_DEPTH} levels deep", event.start_mark)
        if total > _MAX_NODES:
            raise _refused(f"more than {_MAX_NODES} values (aliases expanded)", event.start_mark)
    return yaml.load(text, Loader=_BoundedLoader)


def _read_config_text(path: str | os.PathLike) -> str:
    """The text of a config file: a regular file (a FIFO would block) of at most 1 MiB."""

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"config file {path}: {reason}")

    with open_regular(path, 2**20, fail) as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise fail("not UTF-8 text") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """The defaults, updated by the YAML file at ``path`` (if any), then by ``overrides``
    (``["section.key=value", ...]``). ``!!python`` tags, duplicate keys and documents beyond
    the bounds of :func:`_parse_yaml` are refused."""
    data, source = {}, "<defaults>"
    if path is not None:
        source = str(path)
        try:
            data = _parse_yaml(_read_config_text(path))
        except yaml.YAMLError as err:
            raise ConfigError(f"{source}: invalid YAML: {err}") from None
        data = _sections(data, source)
    if overrides:
        _apply_overrides(data, overrides)
        source = f"{source} with --set overrides"
    return config_from_dict(data, source)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved configuration as YAML, atomically."""
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
