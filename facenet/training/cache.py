"""Training the part after the frozen stages on their outputs, computed once (a CPU's saving).

With ``train.cache_frozen`` the stages up to ``optim.freeze_up_to`` are frozen for the whole
run with their BatchNorm in eval mode: a fixed function of the image. Their output for every
training image, and for its mirror, is computed once (eval mode, no autograd) from the image
as a run with ``data.random_crop: false`` crops it (the 1.125 x resize, centre crop); a sample
is then that output, or its mirror's where the loader draws a flip (``data.hflip``, the same
seeded draw as the images'). ``FeatureHead`` is the rest of the network on those outputs.
Kept: mirroring. Lost: random crops (refused with the cache).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from facenet.config import Config
from facenet.data.batches import TrainCrops, collate_crops, standardize
from facenet.data.images import read_image
from facenet.data.loading import make_loader
from facenet.errors import ConfigError
from facenet.training.optim import backbone_units, frozen_units


class FeatureHead(nn.Module):
    """The network from the unit after ``cut`` on: frozen-prefix outputs (B, C, h, w) ->
    embeddings (B, D) (and logits), as ``whole(images)`` computes them from there. ``whole``
    (the EmbeddingNet, what checkpoints and validation use) is a submodule: the parameters are
    its own."""

    def __init__(self, whole: nn.Module, cut: str | None):
        super().__init__()
        self.whole = whole
        units = backbone_units(whole.backbone)
        frozen = len(frozen_units(whole.backbone, cut))
        self.prefix = [module for _, module in units[:frozen]]  # plain list: not registered
        self.rest = [module for _, module in units[frozen:]]

    def frozen_outputs(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) of the frozen units, in eval mode, without autograd."""
        with torch.no_grad():
            for module in self.prefix:
                was_training = module.training
                images = module.eval()(images)
                module.train(was_training)
        return images

    def forward(self, features: torch.Tensor, return_logits: bool = False):
        for module in self.rest:
            features = module(features)
        return self.whole.from_features(features.flatten(1), return_logits)  # (B, F) in

    @property
    def classifier(self) -> nn.Module | None:
        return self.whole.classifier

    def check_split(self, images: torch.Tensor) -> None:
        """Refuse a backbone whose forward is not its units in order (eval mode)."""
        was_training = self.whole.training
        self.whole.eval()
        with torch.no_grad():
            split, direct = self(self.frozen_outputs(images)), self.whole(images)
        self.whole.train(was_training)
        if not torch.allclose(split, direct, atol=1e-5):
            raise ConfigError(
                "train.cache_frozen: this backbone's forward is not its stages in order; "
                "train without the cache"
            )


def check_cache_settings(cfg: Config) -> None:
    """The settings under which the frozen part is a fixed function of the image."""
    needs = {
        "optim.freeze_backbone_epochs: all": cfg.optim.freeze_backbone_epochs == "all",
        "optim.bn: frozen or frozen_stages": cfg.optim.bn != "adapt",
        "data.random_crop: false": not cfg.data.random_crop,
        "data.dataset: folder or synthetic": cfg.data.dataset != "triplets",
    }
    missing = [setting for setting, held in needs.items() if not held]
    if missing:
        raise ConfigError(
            "train.cache_frozen: true needs " + ", ".join(missing) + " (the frozen stages' "
            "outputs must be one fixed function of each image)"
        )


class CachedOutputs(Dataset):
    """``(outputs[index, flip], label)``: the frozen stages' (2, C, h, w) outputs of each
    image (then of its mirror), the flip drawn as ``TrainCrops`` draws it without a crop."""

    def __init__(self, outputs: torch.Tensor, labels: list[int], crops: TrainCrops):
        self.outputs, self.labels, self.crops = outputs, labels, crops

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        _, _, flip = self.crops.draw(*self.crops.resize_to)  # draws the flip alone
        return self.outputs[index, int(flip)], self.labels[index]


def frozen_outputs_of(head: FeatureHead, folder, cfg: Config, device) -> torch.Tensor:
    """(N, 2, C, h, w) float32 on the CPU: each image of ``folder`` (an IdentityFolder) and
    its mirror through the frozen units, in batches of ``eval.batch_size``."""
    crops, out = TrainCrops(cfg.data.image_size, random_crop=False, hflip=False), []
    for start in range(0, len(folder.samples), cfg.eval.batch_size):
        paths = [path for path, _ in folder.samples[start : start + cfg.eval.batch_size]]
        batch = [crops(crops.prepare(read_image(path, *folder.limits))) for path in paths]
        images = standardize(collate_crops(batch), cfg.data.normalize).to(device)
        if not out:
            head.check_split(images[:2])
        pair = torch.stack([head.frozen_outputs(im) for im in (images, images.flip(-1))], 1)
        out.append(pair.cpu())
    return torch.cat(out)


def cached_loader(head: FeatureHead, loader, cfg: Config, rank: int = 0):
    """A loader drawing ``loader``'s batches (its sampler, its seeds) from the frozen stages'
    outputs instead of images; the note the run prints."""
    samples = loader.dataset  # SeededSamples over the IdentityFolder
    folder = samples.dataset
    device = next(head.parameters()).device
    outputs = frozen_outputs_of(head, folder, cfg, device)
    crops = TrainCrops(cfg.data.image_size, random_crop=False, hflip=cfg.data.hflip)
    dataset = CachedOutputs(outputs, folder.targets, crops)
    sampler = loader.batch_sampler.batch_sampler  # under SeededBatches
    cached = make_loader(dataset, sampler, 0, False, cfg.train.seed, rank)
    mib = outputs.numel() * outputs.element_size() / 2**20
    note = (
        f"train.cache_frozen: the frozen stages' outputs of {len(folder)} images and their "
        f"mirrors, {tuple(outputs.shape[2:])} each, {mib:.0f} MiB"
    )
    return cached, note
