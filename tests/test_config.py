"""The config loader: defaults, overrides, each kind of rejection, the resolved round trip."""

import json
import os
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from facenet.config import (
    RANGES,
    RENAMED_KEYS,
    Config,
    OptimConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)
from facenet.errors import ConfigError, FacenetError
from facenet.evaluation.presets import VerifySettings

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_file():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.mining.margin == 0.2 and cfg.model.embedding_dim == 128


def test_file_overrides_defaults_and_keeps_the_rest(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  embedding_dim: 64\ntrain:\n  epochs: 3\n"))
    assert cfg.model.embedding_dim == 64
    assert cfg.train.epochs == 3
    assert cfg.model.backbone == Config().model.backbone


def test_command_line_overrides_win_and_parse_yaml_scalars(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.1\n")
    cfg = load_config(
        path, ["optim.lr=0.01", "train.amp=bf16", "data.root=null", "data.hflip=false"]
    )
    assert cfg.optim.lr == 0.01
    assert cfg.train.amp == "bf16"
    assert cfg.data.root is None
    assert cfg.data.hflip is False


def test_int_widens_to_float_but_bool_is_not_a_number():
    assert config_from_dict({"optim": {"lr": 1}}).optim.lr == 1.0
    with pytest.raises(ConfigError, match="train.epochs"):
        config_from_dict({"train": {"epochs": True}})


@pytest.mark.parametrize(
    "data, needles",
    [
        ({"train": {"no_such_key": 1}}, ["no_such_key", "valid keys", "epochs"]),
        ({"nosection": {}}, ["nosection", "valid sections"]),
        ({"train": {"epochs": "ten"}}, ["train.epochs", "'ten'", "int"]),
        ({"model": {"backbone": "resnet999"}}, ["model.backbone", "resnet999", "'tiny'"]),
        ({"mining": {"passes": 3}}, ["mining.passes", "3", "1, 2"]),
        ({"data": {"root": 5}}, ["data.root", "5"]),
        ({"train": [1, 2]}, ["section 'train' must be a mapping"]),
    ],
)
def test_rejections_name_key_value_and_options(data, needles):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, source="my.yaml")
    message = str(err.value)
    assert "my.yaml" in message
    for needle in needles:
        assert needle in message


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: No such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "train: [unclosed\n"))


def test_python_object_tags_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    text = f"train: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, text))
    assert not marker.exists()


@pytest.mark.parametrize("item", ["train.epochs", "epochs=3", "a.b.c=1", "train.epochs=[1, 2]"])
def test_malformed_overrides(item):
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, [item])


def test_override_unknown_key_names_it():
    with pytest.raises(ConfigError, match="no_such_key"):
        load_config(None, ["train.no_such_key=1"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.epochs=7", "mining.miner=batch_hard", "eval.pairs=/x/p.txt"])
    out = tmp_path / "config.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg
    assert yaml.safe_load(out.read_text()) == config_to_dict(cfg)
    assert not list(tmp_path.glob("*.tmp"))


def test_shipped_configs_are_valid():
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert paths
    for path in paths:
        load_config(path)


def run_train(*args):
    """The installed ``facenet-train`` console command (beside this interpreter)."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("facenet-train")), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_train_script_exits_2_with_one_line_naming_the_key():
    proc = run_train("--config", "configs/demo.yaml", "--set", "train.no_such_key=1")
    assert proc.returncode == 2
    assert "no_such_key" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_train_script_missing_config_exits_2():
    proc = run_train("--config", "configs/does_not_exist.yaml")
    assert proc.returncode == 2 and "does_not_exist.yaml" in proc.stderr


def test_print_config_shows_the_resolved_values():
    proc = run_train("--config", "configs/demo.yaml", "--set", "train.epochs=4", "--print-config")
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout)["train"]["epochs"] == 4


def test_scientific_notation_is_a_float(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  lr: 3e-4\n"), ["optim.weight_decay=5E-4"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.weight_decay == 5e-4
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=1e-3x"])
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(None, ["train.epochs=1e3"])  # an int key does not take a float


def test_one_pass_with_chunks_is_refused_naming_both_keys():
    assert Config().mining.passes == "auto"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["mining.passes=1", "train.chunk_size=64"])
    message = str(err.value)
    assert "mining.passes: 1" in message and "train.chunk_size: 64" in message
    assert "two-pass" in message and "mining.passes: 2 or auto" in message
    assert isinstance(err.value, FacenetError) and isinstance(err.value, ValueError)
    for passes in ("auto", 2):
        cfg = config_from_dict({"mining": {"passes": passes}, "train": {"chunk_size": 64}})
        assert cfg.mining.passes == passes
    assert config_from_dict({"mining": {"passes": 1}}).mining.passes == 1
    with pytest.raises(ConfigError, match="mining.passes"):
        load_config(None, ["mining.passes=3"])


def test_graph_memory_is_opt_in():
    assert Config().logging.graph_memory is False
    assert load_config(None, ["logging.graph_memory=true"]).logging.graph_memory is True


@pytest.mark.parametrize("size", [-1, 1])
def test_a_chunk_size_no_batchnorm_can_use_is_refused_naming_the_key(size):
    with pytest.raises(ConfigError, match=f"train.chunk_size: {size}; 0 \\(off\\) or at least 2"):
        load_config(None, [f"train.chunk_size={size}"])


def test_log_interval_zero_is_refused_at_load_naming_the_key_and_range():
    with pytest.raises(ConfigError, match=r"train.log_interval: 0 is out of range; allowed: \[1, "):
        load_config(None, ["train.log_interval=0"])


def test_zero_epochs_would_train_on_nothing_and_is_refused():
    with pytest.raises(ConfigError, match=r"train.epochs: 0 is out of range"):
        load_config(None, ["train.epochs=0"])


def _just_outside(allowed):
    """A value just below the range's low end (its open end itself, when open)."""
    return allowed.low if allowed.low_open else allowed.low - 1


def _numeric_type(tp):
    """int or float for a numeric key (also ``int | Literal["auto"]``), else None."""
    if tp in (int, float):
        return tp
    numeric = [a for a in typing.get_args(tp) if a in (int, float)]
    return numeric[0] if len(numeric) == 1 else None


def numeric_keys():
    hints = {name: typing.get_type_hints(tp) for name, tp in typing.get_type_hints(Config).items()}
    return {
        f"{section}.{key}": _numeric_type(tp)
        for section, keys in hints.items()
        for key, tp in keys.items()
        if _numeric_type(tp) is not None
    }


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_ranged_key_refuses_a_value_below_its_range_naming_it(key):
    if key not in numeric_keys():
        pytest.skip(f"{key} is not a key of this configuration")
    value = numeric_keys()[key](_just_outside(RANGES[key]))
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{key}: {value!r}[ ;]"):
        config_from_dict({section: {name: value}})


@pytest.mark.parametrize(
    "key",
    [
        "data.synthetic_identities",
        "data.synthetic_images_per_identity",
        "data.synthetic_heldout_identities",
        "data.synthetic_heldout_images_per_identity",
    ],
)
def test_synthetic_counts_past_what_the_generator_can_write_are_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=f"{key}: 2000000000 is out of range; allowed: .2, "):
        load_config(None, [f"{key}=2000000000"])


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_floats_are_refused(value):
    with pytest.raises(ConfigError, match="optim.lr: .* is out of range"):
        load_config(None, [f"optim.lr={value}"])


def test_every_numeric_key_has_a_range_or_is_a_verification_setting():
    # the eval section's verification settings: VerifySettings checks them, and only it
    settings = {f"eval.{f.name}" for f in fields(VerifySettings)} & set(numeric_keys())
    assert set(numeric_keys()) - set(RANGES) == settings
    assert {"eval.n_folds", "eval.far_target", "eval.batch_size"} <= settings


def test_the_schedule_keys_have_their_ranges_and_one_warmup_length():
    cfg = load_config(None, ["optim.warmup_steps=500", "optim.min_lr_ratio=0"])
    assert (cfg.optim.warmup_steps, cfg.optim.min_lr_ratio, cfg.optim.warmup_epochs) == (500, 0, 0)
    assert OptimConfig().min_lr_ratio == 0.01  # the floor the cosine had before it was a key
    with pytest.raises(ConfigError, match=r"optim.min_lr_ratio: 1.5 is out of range"):
        load_config(None, ["optim.min_lr_ratio=1.5"])
    with pytest.raises(ConfigError, match="warmup_steps: 10 and optim.warmup_epochs: 2"):
        load_config(None, ["optim.warmup_steps=10", "optim.warmup_epochs=2"])


def test_an_upper_bound_is_named_too():
    with pytest.raises(ConfigError, match=r"model.dropout: 1.0 is out of range; allowed: \[0, 1\)"):
        load_config(None, ["model.dropout=1.0"])
    with pytest.raises(ConfigError, match=r"eval.far_target: 1.5: must lie in \(0, 1\]"):
        load_config(None, ["eval.far_target=1.5"])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("n_folds", 1),
        ("far_target", 0.0),
        ("far_target", 1.5),
        ("batch_size", 0),
        ("distance", "manhattan"),
        ("preprocess", "stretch"),
        ("grid", "fine"),
        ("features", "logits"),
        ("threshold_rule", "median"),
        ("scoring", "float32"),
    ],
)
def test_an_eval_setting_is_refused_naming_the_file_the_key_and_the_value_typed(
    tmp_path, key, value
):
    path = write(tmp_path, yaml.safe_dump({"eval": {key: value}}))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: eval.{key}: {value!r}: ")  # VerifySettings' words
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize(
    "text",
    ["train:\n  epochs: 3\n  epochs: 4\n", "train:\n  epochs: 3\ntrain:\n  seed: 1\n"],
    ids=["key", "section"],
)
def test_duplicate_yaml_keys_are_refused(tmp_path, text):
    with pytest.raises(ConfigError, match="duplicate key '(epochs|train)'"):
        load_config(write(tmp_path, text))


def test_a_fifo_as_config_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)
    for other in ("/dev/zero", tmp_path):  # a device read forever; a folder
        with pytest.raises(ConfigError, match="not a regular file"):
            load_config(other)


def test_a_config_file_over_one_mib_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as fh:
        fh.truncate(2**20 + 1)  # sparse: declares its size without writing it
    with pytest.raises(ConfigError, match=r"big.yaml: 1048577 bytes is larger than"):
        load_config(path)
    path.write_bytes(b"\xff")
    with pytest.raises(ConfigError, match="big.yaml: not UTF-8"):
        load_config(path)


# --------------------------------------------------------------------------- choices = registries


def _choices(section: str, key: str) -> tuple:
    """The ``Literal[...]`` choices of ``section.key`` in facenet.config."""
    section_type = typing.get_type_hints(Config)[section]
    return typing.get_args(typing.get_type_hints(section_type)[key])


def _registries() -> dict:
    """Each choice key and the library's table it selects from."""
    from facenet.metric import MINERS
    from facenet.metric.distances import DISTANCE_NAMES
    from facenet.metric.losses import REDUCTIONS
    from facenet.metric.margin_softmax import CROSS_ENTROPIES
    from facenet.metric.miners import FALLBACKS
    from facenet.metric.triplet_margin_miner import TRIPLET_TYPES
    from facenet.models.backbones import BACKBONES
    from facenet.training import step
    from facenet.training.optim import OPTIMIZERS, SCHEDULES

    return {
        "model.backbone": BACKBONES,
        "mining.miner": MINERS,
        "mining.type_of_triplets": TRIPLET_TYPES,
        "mining.fallback": FALLBACKS,
        "mining.distance": DISTANCE_NAMES,
        "loss.distance": DISTANCE_NAMES,
        "loss.reduction": REDUCTIONS,
        "loss.ce": CROSS_ENTROPIES,
        "optim.name": tuple(OPTIMIZERS),
        "optim.schedule": SCHEDULES,
        "train.amp": tuple(step._AUTOCAST),  # the step's autocast table
    }


# Choice keys whose values the library tests with ifs, not a named table (yet).
_NO_REGISTRY = {
    "data.dataset",
    "data.normalize",
    "data.on_corrupt",
    "mining.passes",
    "train.device",
    "optim.bn",
}


@pytest.mark.parametrize("key", sorted(_registries()))
def test_every_choice_list_is_the_registry_it_selects_from(key):
    section, name = key.split(".")
    assert set(_choices(section, name)) == set(_registries()[key]), key


def test_every_choice_key_is_checked_against_a_registry_or_listed_as_without_one():
    choice_keys = set()
    for section, section_type in typing.get_type_hints(Config).items():
        for name, hint in typing.get_type_hints(section_type).items():
            if typing.get_origin(hint) is typing.Literal:
                choice_keys.add(f"{section}.{name}")
    assert choice_keys == set(_registries()) | _NO_REGISTRY


def test_training_and_evaluation_share_one_distance_list():
    from facenet.evaluation import presets
    from facenet.evaluation.protocol import default_thresholds
    from facenet.metric.distances import DISTANCE_NAMES

    assert presets._CHOICES["distance"] is DISTANCE_NAMES
    for name in DISTANCE_NAMES:  # every one has default grids
        assert len(default_thresholds(name)) == len(default_thresholds("squared"))


# --------------------------------------------------------------------------- renamed keys


@pytest.mark.parametrize("old, new", sorted(RENAMED_KEYS.items()))
def test_an_old_key_in_a_file_still_works_with_one_warning_naming_the_new(tmp_path, old, new):
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: 6}}))
    with pytest.warns(UserWarning, match=f"{old} is now {new}") as record:
        cfg = load_config(path)
    assert len(record) == 1
    assert getattr(getattr(cfg, section), new.split(".")[1]) == 6
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)  # the resolved config a run writes uses the new names
    text = saved.read_text()
    assert new.split(".")[1] in text and f"{key}:" not in text


@pytest.mark.parametrize("old, new", sorted(RENAMED_KEYS.items()))
def test_an_old_key_in_set_still_works_and_overrides_the_file(tmp_path, old, new):
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: 6}}))
    cfg = load_config(path, [f"{new}=8"])  # the new name replaces the file's old one
    assert getattr(getattr(cfg, section), new.split(".")[1]) == 8
    with pytest.warns(UserWarning, match=f"{old} is now {new}"):
        cfg = load_config(None, [f"{old}=4"])
    assert getattr(getattr(cfg, section), new.split(".")[1]) == 4


def test_old_and_new_spelling_of_one_key_in_a_file_are_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("eval:\n  holdout_identities: 4\n  heldout_identities: 6\n")
    with pytest.raises(ConfigError, match="holdout_identities and eval.heldout_identities"):
        load_config(path)


def test_a_run_written_before_the_rename_keeps_its_heldout_identities(tmp_path):
    from facenet.data.heldout import HeldOutSettings, choose_held_out

    chosen = {"val": ["a", "b"], "test": ["c", "d"]}
    (tmp_path / "holdout.json").write_text(json.dumps(chosen))  # the old record's name
    listing = {name: ["1.png", "2.png"] for name in "abcdefgh"}
    cfg = load_config(None, ["eval.heldout_identities=6"])  # a new draw would pick 6
    settings = HeldOutSettings(cfg.eval.heldout_identities, seed=cfg.train.seed)
    assert choose_held_out(listing, tmp_path, ["val", "test"], settings, False) == (chosen, None)
    assert not (tmp_path / "heldout.json").exists()


def test_image_size_takes_height_and_width_from_yaml_and_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  image_size: [112, 96]\n")
    assert load_config(path).data.image_size == [112, 96]
    cfg = load_config(None, ["data.image_size=[112,96]"])
    assert cfg.data.image_size == [112, 96]
    save_config(cfg, tmp_path / "resolved.yaml")  # written back loadable
    assert load_config(tmp_path / "resolved.yaml").data.image_size == [112, 96]
    assert load_config(None, ["data.image_size=64"]).data.image_size == 64


@pytest.mark.parametrize(
    "value, message",
    [
        ("[112,5000]", r"data.image_size: \[112, 5000\]: side 5000 is out of range; allowed"),
        ("[4,96]", r"side 4 is out of range; allowed: \[8, 4096\]"),
        ("[112,96,3]", r"expected one int \(a square input\) or \[height, width\]"),
        ("[112.5,96]", "is not int or a list of int"),
        ("[true,96]", "is not int or a list of int"),
    ],
)
def test_each_side_of_image_size_is_checked(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"data.image_size={value}"])


def test_a_list_is_refused_for_a_scalar_key():
    with pytest.raises(ConfigError, match=r"optim.lr: expected float, got \[1\]"):
        load_config(None, ["optim.lr=[1]"])


# --------------------------------------------------------------------------- hostile documents


def _alias_bomb(levels=9, width=9):
    """A flow list whose aliases expand to width**levels values in a few hundred bytes."""
    nests = ["[" + ",".join(["lol"] * width) + "]"]
    nests += ["[" + ",".join([f"*a{i}"] * width) + "]" for i in range(levels - 1)]
    return "[" + ", ".join(f"&a{i} {nest}" for i, nest in enumerate(nests)) + "]"


HOSTILE_VALUES = {
    "list key": ("{? [a, b]: 1}", "a key must be a plain value"),
    "mapping key": ("{? {a: 1}: 1}", "a key must be a plain value"),
    "deep list": ("[" * 5000 + "]" * 5000, "nested more than 16 levels"),
    "deep mapping": ("{a: " * 3000 + "1" + "}" * 3000, "nested more than 16 levels"),
    "5000-digit integer": ("9" * 5000, "an integer of 5000 characters"),
    "long hex integer": ("0x" + "f" * 60, "an integer of 62 characters"),
    "alias bomb": (_alias_bomb(), "more than 10000 values"),
    "aliases of a mapping": ("[&m {a: [1, 2, 3]}" + ", *m" * 4000 + "]", "more than 10000"),
    "a long plain list": ("[" + ", ".join(["1"] * 20000) + "]", "more than 10000 values"),
}


@pytest.mark.parametrize("value, message", HOSTILE_VALUES.values(), ids=HOSTILE_VALUES)
def test_a_hostile_document_is_refused_in_one_line_naming_the_file(tmp_path, value, message):
    path = write(tmp_path, f"data:\n  image_size: {value}\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(path) in str(err.value) and len(str(err.value)) < 1000
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [f"data.image_size={value}"])
    assert len(str(err.value)) < 1000


def test_the_bomb_is_a_few_hundred_bytes_and_refused_at_once(tmp_path):
    assert len(_alias_bomb()) < 400
    path = write(tmp_path, f"data:\n  image_size: {_alias_bomb()}\n")
    with pytest.raises(ConfigError, match="aliases expanded"):
        load_config(path)


def test_a_yaml_merge_key_merges_and_its_own_keys_win(tmp_path):
    text = "optim: &o\n  lr: 0.01\n  momentum: 0.8\neval:\n  every: 2\n"
    text += "loss:\n  <<: {margin: 0.3, distance: cosine}\n  margin: 0.4\n"
    cfg = load_config(write(tmp_path, text))
    assert (cfg.loss.margin, cfg.loss.distance, cfg.optim.lr) == (0.4, "cosine", 0.01)
    with pytest.raises(ConfigError, match="duplicate key 'margin'"):
        load_config(write(tmp_path, "loss:\n  <<: {distance: cosine}\n  margin: 1\n  margin: 2\n"))


def test_aliases_within_the_bounds_still_load_and_messages_stay_short(tmp_path):
    text = "train:\n  seed: &s 7\n  epochs: *s\n"
    assert load_config(write(tmp_path, text)).train.epochs == 7
    # Expanded below the bound, yet its repr is long: the message shows a bounded excerpt.
    with pytest.raises(ConfigError, match=r"data.root: \[\[.*\.\.\. is not str") as err:
        load_config(None, [f"data.root={_alias_bomb(levels=4)}"])
    assert len(str(err.value)) < 1000


def test_a_huge_integer_given_in_a_dict_is_refused_in_a_short_message():
    for value in (10**5000, [112, 10**5000]):
        with pytest.raises(ConfigError, match="<a huge integer>.* out of range") as err:
            config_from_dict({"data": {"image_size": value}})
        assert len(str(err.value)) < 200
