"""Convert sandberg's Inception-ResNet-v1 to our weights: ``SRC DST``, without TensorFlow.

SRC is davidsandberg/facenet's frozen graph ``.pb`` (a release graph, run with phase_train
False: its training branches are left out; or its batch norms folded into the kernels by
TensorFlow's graph tools) or checkpoint (``model-*.ckpt-N`` or its ``.index``, next to its
``.data-00000-of-00001``; other variables, such as the classifier's and the optimizer's, are
left out); DST is a weights export (``facenet.wings.after_training.loading.save_weights``:
inception_resnet_v1, the graph's embedding width, its input size, "fixed" standardisation
(x - 127.5) / 128) that ``load_model``, ``--checkpoint`` and ``model.weights`` read. Every
parameter comes from SRC, and every float constant a graph runs is used, or nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from facenet.cli.common import add_threads_argument, check_outputs, run_command
from facenet.distributed import set_threads
from facenet.errors import DataError, WeightsError
from facenet.files import open_regular
from facenet.models.embedding import EmbeddingNet
from facenet.wings.after_training.loading import TrainedModel, save_weights
from facenet.wings.publishers.sandberg import MappingError, graph_state_dict, sandberg_state_dict
from facenet.wings.publishers.tf_graph import GraphError, parse_bundle, parse_graph

MAX_BYTES = 2**31  # sandberg's graphs are about 95 MB


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-convert``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", metavar="SRC", help="sandberg's frozen graph (.pb) or checkpoint")
    parser.add_argument("out", metavar="DST", help="the weights file to write (.pt)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace this command's earlier output"
    )
    add_threads_argument(parser)
    return parser


def _read(path) -> bytes:
    with open_regular(path, MAX_BYTES, lambda why: WeightsError(f"{path}: {why}")) as fh:
        return fh.read()


def read_sandberg(src) -> tuple[dict, int, str]:
    """Our state dict from a frozen graph (``.pb``) or a checkpoint (``PREFIX`` or
    ``PREFIX.index``, with ``PREFIX.data-00000-of-00001``), the input size and what was read;
    WeightsError naming ``src``."""
    try:
        if str(src).endswith(".pb"):
            nodes = parse_graph(_read(src))
            state, size, ignored = graph_state_dict(nodes)
            dead = f" ({ignored} constants of phase_train's training branches left out)"
            return state, size, f"{len(nodes)} nodes" + (dead if ignored else "")
        prefix = str(src).removesuffix(".index")
        if not Path(f"{prefix}.index").exists():
            raise WeightsError(
                f"{src}: neither a frozen graph (.pb) nor a TensorFlow checkpoint "
                f"({prefix}.index not found)"
            )
        tensors = parse_bundle(_read(f"{prefix}.index"), _read(f"{prefix}.data-00000-of-00001"))
        state, used = sandberg_state_dict(tensors)
    except (GraphError, MappingError) as err:
        raise WeightsError(f"{src}: {err}") from None
    left = len(tensors) - len(used)  # the classifier, optimizer slots, moving averages
    return state, 160, f"{len(tensors)} float variables ({left} not the network's)"


def convert(src) -> tuple[TrainedModel, str]:
    """The network sandberg's file ``src`` holds, and what was read."""
    state, size, read = read_sandberg(src)
    dim = state["embedding.linear.weight"].shape[0]
    model = EmbeddingNet("inception_resnet_v1", dim)
    model.load_state_dict(state)
    architecture = {"backbone": "inception_resnet_v1", "embedding_dim": dim, "dropout": 0.0}
    return TrainedModel(model.eval(), size, "fixed", "weights", str(src), architecture), read


def source_files(src: str) -> dict[str, str]:
    """The files SRC may name: itself, or its checkpoint's index and data."""
    prefix = src.removesuffix(".index")
    return {"SRC": src, "index": f"{prefix}.index", "data": f"{prefix}.data-00000-of-00001"}


def _convert(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    if not Path(args.out).parent.is_dir():  # found before the conversion, not after
        raise DataError(f"{args.out}: its folder {Path(args.out).parent} does not exist")
    check_outputs(args, files=source_files(args.src))
    trained, read = convert(args.src)
    params = sum(p.numel() for p in trained.model.parameters())
    save_weights(trained, args.out)
    print(
        f"read {args.src}: {read}, {params:,} parameters; wrote {Path(args.out)} "
        f"(inception_resnet_v1, {trained.embedding_dim}-d embeddings, {trained.image_size} px, "
        f"fixed standardisation)"
    )


def main(argv: list[str] | None = None) -> int:
    """Convert; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _convert(args))


if __name__ == "__main__":
    sys.exit(main())
