"""A network's weights in the facenet-pytorch layout, for the tests of loading ports."""

from facenet.models.embedding import EmbeddingNet
from facenet.wings.publishers.inception_resnet_v1 import _PORT_HEAD_TO_EMBEDDING_NET


def port_state_dict(model: EmbeddingNet) -> dict:
    """``model``'s weights in the facenet-pytorch layout (the inverse of the documented map)."""
    to_port = {ours: port for port, ours in _PORT_HEAD_TO_EMBEDDING_NET.items()}
    state = {}
    for key, value in model.state_dict().items():
        prefix = next((p for p in to_port if key.startswith(p)), None)
        if prefix is not None:
            state[to_port[prefix] + key[len(prefix) :]] = value
        else:
            state[key.removeprefix("backbone.")] = value
    return state
