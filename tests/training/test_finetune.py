"""Fine-tuning options: stages frozen for the whole run, BatchNorm frozen or adapted, early
stopping on the validation pairs (and its resume)."""

from __future__ import annotations

import json

import pytest
import torch
from test_run import synthetic_data, train

from facenet.config import load_config
from facenet.errors import ConfigError
from facenet.training.build import build_trainer
from facenet.training.optim import backbone_units, frozen_units
from facenet.training.state import Progress

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CPU = torch.device("cpu")


def trainer_for(*settings, steps=4):
    cfg = load_config(None, ["train.device=cpu", "data.image_size=32", *settings])
    return build_trainer(cfg, num_classes=None, device=CPU, steps_per_epoch=steps)


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(8, 3, 32, 32, generator=generator)
    return images, torch.arange(4).repeat_interleave(2)  # 4 identities x 2


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- which layers train


def test_stages_frozen_for_the_run_have_no_grad_and_no_optimizer_state():
    trainer = trainer_for("optim.freeze_backbone_epochs=all", "optim.freeze_up_to='1'")
    model, before = trainer.core_model, snapshot(trainer.core_model)
    frozen = {n for n, _ in model.named_parameters() if n.startswith(("backbone.0.", "backbone.1"))}
    assert frozen and all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert in_optimizer == {id(p) for n, p in named.items() if n not in frozen}
    assert [g["name"] for g in trainer.optimizer.param_groups] == ["backbone", "head"]
    for seed in range(3):
        assert "skipped" not in trainer.train_step(*batch(seed))
    after = model.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in frozen)
    assert all(named[n].grad is None for n in frozen)
    assert not any(id(named[n]) in map(id, trainer.optimizer.state) for n in frozen)
    moved = {n for n in named if n not in frozen and not torch.equal(after[n], before[n])}
    assert "backbone.2.0.weight" in moved and "embedding.linear.weight" in moved
    # The whole backbone: only the head trains (one group at lr).
    only_head = trainer_for("optim.freeze_backbone_epochs=all")
    assert [(g["name"], g["lr"]) for g in only_head.optimizer.param_groups] == [("head", 1e-3)]


def test_a_cut_inside_a_sequential_stage_freezes_its_first_elements():
    from facenet.models.embedding import EmbeddingNet

    backbone = EmbeddingNet("mobilefacenet", 8).backbone
    units = [name for name, _ in backbone_units(backbone)]
    assert units[:3] == ["stem", "stem_dw", "blocks.0"] and units[-3:] == [
        "blocks.14",
        "conv_1x1",
        "gdc",
    ]
    assert frozen_units(backbone, "blocks.1") == ["stem", "stem_dw", "blocks.0", "blocks.1"]
    assert frozen_units(backbone, "blocks") == units[:17]  # the whole sequential stage
    with pytest.raises(ValueError, match="such as blocks.0"):
        frozen_units(backbone, "blocks.15")


# --------------------------------------------------------------------------- BatchNorm


def bn_buffers(model, prefix=""):
    return {
        k: v.clone()
        for k, v in model.state_dict().items()
        if k.startswith(prefix) and ("running_" in k or "num_batches" in k)
    }


@pytest.mark.parametrize("passes", [1, 2])
def test_frozen_batchnorm_keeps_its_running_statistics_bit_for_bit(passes):
    frozen = trainer_for("optim.bn=frozen", f"mining.passes={passes}")
    adapt = trainer_for(f"mining.passes={passes}")
    for trainer in (frozen, adapt):
        before = bn_buffers(trainer.core_model)
        trainer.train_mode()
        for seed in range(2):
            assert "skipped" not in trainer.train_step(*batch(seed))
        after = bn_buffers(trainer.core_model)
        same = {k for k in before if torch.equal(before[k], after[k])}
        assert same == (set(before) if trainer is frozen else set())


def test_frozen_stages_batchnorm_is_in_eval_mode_and_used_in_the_forward():
    trainer = trainer_for(
        "optim.bn=frozen_stages", "optim.freeze_backbone_epochs=all", "optim.freeze_up_to='1'"
    )
    model = trainer.core_model
    before = bn_buffers(model)
    trainer.train_mode()
    modes = {n: m.training for n, m in model.named_modules() if "BatchNorm" in type(m).__name__}
    assert modes == {
        "backbone.0.1": False,
        "backbone.1.1": False,
        "backbone.2.1": True,
        "backbone.3.1": True,
        "embedding.bn": True,
    }
    images, labels = batch()
    # The frozen prefix computes what it computes in eval mode (the running statistics).
    prefix = torch.nn.Sequential(*list(model.backbone)[:2])
    with torch.no_grad():
        train_mode_out = prefix(images)
        prefix.eval()
        assert torch.equal(train_mode_out, prefix(images))
        trainer.train_mode()
    trainer.train_step(images, labels)
    after = bn_buffers(model)
    changed = {k.rsplit(".", 1)[0] for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"backbone.2.1", "backbone.3.1", "embedding.bn"}


def test_frozen_stages_batchnorm_without_frozen_stages_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match="optim.bn: frozen_stages .*freeze_backbone_epochs"):
        trainer_for("optim.bn=frozen_stages")


# --------------------------------------------------------------------------- early stopping


def progress_with(accuracies: list[float | None]) -> Progress:
    """Progress after epochs 1.. with these validation accuracies (None: not validated)."""
    progress = Progress()
    for epoch, accuracy in enumerate(accuracies, start=1):
        record = {"epoch": epoch}
        if accuracy is not None:
            record["validation"] = {"accuracy_mean": accuracy}
            if accuracy > progress.best:
                progress.best, progress.best_epoch = accuracy, epoch
        progress.history.append(record)
    return progress


def test_patience_counts_validations_since_the_best_one():
    assert progress_with([0.6, 0.7, 0.7]).patience_spent(2) is None  # equal is not better
    spent = progress_with([0.6, 0.7, 0.7, 0.65]).patience_spent(2)
    assert spent.startswith("early stop after epoch 4: 2 validations")
    assert "than epoch 2's 0.7000" in spent
    # Epochs without validation (eval.every > 1) do not count.
    assert progress_with([0.6, 0.7, None, 0.5, None]).patience_spent(2) is None
    assert progress_with([0.6, 0.7, None, 0.5, None, 0.6]).patience_spent(2) is not None
    assert progress_with([0.6, 0.5, 0.4]).patience_spent(0) is None  # off


PATIENT = ["eval.every=1", "eval.patience=1", "optim.schedule=none", "optim.bn=frozen"]


def read_run(run) -> tuple[dict, list]:
    summary = json.loads((run / "summary.json").read_text())
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def test_patience_stops_the_run_keeps_the_best_and_a_resume_stops_at_the_same_epoch(
    tmp_path, capsys
):
    # A learning rate of 1e-9 with frozen BatchNorm barely moves the embeddings: after the
    # first validation no other is better, so one validation of patience stops after epoch 2.
    data = synthetic_data(tmp_path / "data")
    whole = tmp_path / "whole"
    code, out, err = train(capsys, whole, *PATIENT, "optim.lr=1e-9", "train.epochs=5", data=data)
    assert code == 0, err
    summary, history = read_run(whole)
    accuracies = [r["validation"]["accuracy_mean"] for r in history]
    stop = len(history)
    assert stop < 5 and summary["early_stop"].startswith(f"early stop after epoch {stop}")
    assert summary["early_stop"] in out
    best = summary["best_epoch"]
    assert accuracies[best - 1] == max(accuracies) and stop == best + 1
    assert summary["test"]["best"]["epoch"] == best
    # The same run in two sessions: one epoch, then --resume with the full length.
    parts = tmp_path / "parts"
    settings = [*PATIENT, "optim.lr=1e-9"]
    assert train(capsys, parts, *settings, "train.epochs=1", data=data)[0] == 0
    code, _, err = train(capsys, parts, *settings, "train.epochs=5", flags=["--resume"], data=data)
    assert code == 0, err
    resumed, resumed_history = read_run(parts)
    assert [r["validation"]["accuracy_mean"] for r in resumed_history] == accuracies
    assert (resumed["best_epoch"], resumed["early_stop"]) == (best, summary["early_stop"])


# --------------------------------------------------------------------------- cached frozen outputs

CACHED = [
    "optim.freeze_backbone_epochs=all",
    "optim.freeze_up_to='1'",
    "optim.bn=frozen_stages",
    "data.random_crop=false",
]


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("ce_weight", [0.0, 1.0])
def test_a_step_on_cached_outputs_is_the_step_on_the_images(passes, ce_weight):
    """Loss and every gradient of the step on the frozen stages' outputs equal, in float64,
    those of the same step on the images the outputs were computed from."""
    settings = [*CACHED, f"mining.passes={passes}", f"loss.ce_weight={ce_weight}"]
    images, labels = batch(seed=3)
    results = {}
    for cached in (False, True):
        torch.manual_seed(0)  # the same initial weights
        cfg = load_config(None, ["train.device=cpu", "data.image_size=32", *settings])
        cfg.train.cache_frozen = cached
        trainer = build_trainer(cfg, num_classes=4, device=CPU, steps_per_epoch=4)
        trainer.step.core.double()
        trainer.train_mode()
        inputs = images.double()
        if cached:
            inputs = trainer.step.core.frozen_outputs(inputs)
            assert inputs.shape == (8, 64, 8, 8)  # after stage 1 of the tiny backbone
        result = trainer.step(inputs, labels)
        grads = {n: p.grad for n, p in trainer.core_model.named_parameters() if p.grad is not None}
        results[cached] = result.loss, grads
    (loss, grads), (cached_loss, cached_grads) = results[False], results[True]
    assert loss.dtype == torch.float64 and loss > 0
    torch.testing.assert_close(cached_loss, loss, rtol=1e-12, atol=1e-12)
    assert set(cached_grads) == set(grads) and "backbone.2.0.weight" in grads
    assert not any(n.startswith(("backbone.0.", "backbone.1.")) for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(cached_grads[name], grad, rtol=1e-10, atol=1e-12)


def test_cached_batches_are_the_frozen_outputs_of_the_uncropped_batches_flips_included(
    tmp_path,
):
    from facenet.training.build import build_data
    from facenet.training.cache import cached_loader

    cfg = load_config(
        None,
        [
            *CACHED,
            *synthetic_data(tmp_path / "data"),
            "train.device=cpu",
            "data.image_size=16",
            "data.p=3",
            "data.k=2",
        ],
    )
    cfg.data.num_workers = 0
    data = build_data(cfg, tmp_path / "run")
    cfg.train.cache_frozen = True
    trainer = build_trainer(cfg, num_classes=None, device=CPU, steps_per_epoch=2)
    head = trainer.step.core
    loader, note = cached_loader(head, data.loader, cfg)
    assert note.startswith("train.cache_frozen: the frozen stages' outputs of 18 images")
    data.sampler.set_epoch(3)
    flipped = 0
    for (images, labels), (outputs, cached_labels) in zip(data.loader, loader, strict=True):
        assert torch.equal(labels, cached_labels)
        images = images.float().sub(127.5).div(128)  # data.normalize: fixed
        expected = head.frozen_outputs(images)
        torch.testing.assert_close(outputs, expected, rtol=1e-5, atol=1e-5)
        mirrored = head.frozen_outputs(images.flip(-1))
        flipped += sum(not torch.allclose(o, e, atol=1e-5) for o, e in zip(outputs, mirrored))
    assert flipped > 0  # the draws that kept the image differ from their mirror's outputs


def test_the_cache_refuses_settings_that_change_the_frozen_outputs_naming_them():
    with pytest.raises(ConfigError, match="optim.bn: frozen or .*data.random_crop: false"):
        trainer_for("train.cache_frozen=true", "optim.freeze_backbone_epochs=all")


def test_a_cached_run_trains_validates_and_saves_the_whole_network(tmp_path, capsys):
    data = synthetic_data(tmp_path / "data")
    runs = {}
    for cached in ("false", "true"):
        run = tmp_path / f"cached_{cached}"
        settings = [*CACHED, f"train.cache_frozen={cached}", "eval.every=1", "train.epochs=2"]
        code, out, err = train(capsys, run, *settings, data=data)
        assert code == 0, err
        assert ("train.cache_frozen: the frozen" in err) == (cached == "true")
        runs[cached] = read_run(run)[1]
    for plain, cached in zip(runs["false"], runs["true"], strict=True):
        assert cached["loss"] == pytest.approx(plain["loss"], rel=1e-4)
        assert cached["validation"]["accuracy_mean"] == plain["validation"]["accuracy_mean"]
