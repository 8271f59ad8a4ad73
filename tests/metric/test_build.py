"""The miners and losses a configuration names: a module that holds one not named is not
imported, so a default run loads the semi-hard miner and the triplet loss only."""

import json
import subprocess
import sys

# Each configuration built, in this order, and the modules it imports (none for the defaults).
STEPS = {
    "build_miner(M()), build_loss(L()), build_margin_loss(L())": [],
    "build_miner(M(miner='batch_hard'))": ["facenet.metric.batch_hard_miner"],
    "build_miner(M(miner='triplet_margin'))": ["facenet.metric.triplet_margin_miner"],
    "build_margin_loss(L(ce='arcface'))": ["facenet.metric.margin_softmax"],
}

SCRIPT = """
import json, sys
from facenet.config import LossConfig as L, MiningConfig as M
from facenet.metric import build_loss, build_margin_loss, build_miner

imported = []
for step in json.loads(sys.argv[1]):
    before = set(sys.modules)
    exec(step)
    imported.append(sorted(m for m in set(sys.modules) - before if m.startswith("facenet")))
print(json.dumps(imported))
"""


def test_each_configuration_imports_only_the_miner_and_loss_it_names():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(list(STEPS))],
        capture_output=True,
        text=True,
        check=True,
    )
    for (step, expected), imported in zip(STEPS.items(), json.loads(done.stdout)):
        assert imported == expected, step
