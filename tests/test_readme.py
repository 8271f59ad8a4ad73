"""README's Python snippets run as written (their paths swapped for files made here)."""

import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from facenet.models.embedding import EmbeddingNet
from facenet.wings.after_training.loading import TrainedModel, save_weights

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_shows_two_python_snippets():
    assert len(python_blocks()) == 2


def test_the_miner_and_loss_snippet_runs_and_trains(one_thread):
    scope: dict = {}
    exec(python_blocks()[0], scope)  # noqa: S102 (the README's own code)
    model, loss = scope["model"], scope["loss"]
    assert loss.requires_grad and loss.item() >= 0
    assert all(p.grad is not None for p in model.embedding.parameters())  # it reached the model
    assert len(scope["triplets"].anchor) > 0  # the sparse path mined without a graph


def test_the_trained_model_snippet_embeds_an_image(tmp_path, one_thread):
    weights, image = tmp_path / "model.pt", tmp_path / "face.png"
    architecture = {"backbone": "tiny", "embedding_dim": 16, "dropout": 0.0}
    model = EmbeddingNet("tiny", 16).eval()
    save_weights(TrainedModel(model, 32, "fixed", "weights", "", architecture), weights)
    pixels = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(image)
    code = python_blocks()[1]
    code = code.replace("runs/demo/best.pt", str(weights))
    code = re.sub(r'path = "[^"]*"', f'path = "{image}"', code)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 (the README's own code)
    embedding = scope["embedding"]
    assert embedding.shape == (1, 16) and not embedding.requires_grad
    assert torch.allclose(embedding.norm(dim=1), torch.ones(1), atol=1e-5)
