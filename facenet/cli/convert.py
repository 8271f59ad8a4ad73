"""Convert sandberg's frozen Inception-ResNet-v1 graph to our weights: ``SRC.pb DST``.

SRC is davidsandberg/facenet's frozen ``GraphDef`` (its batch norms as variables, or folded
into the kernels by TensorFlow's graph tools), read without TensorFlow; DST is a weights export
(``facenet.inference.loading.save_weights``: inception_resnet_v1, the graph's embedding width,
its input size, "fixed" standardisation (x - 127.5) / 128) that ``load_model``,
``--checkpoint`` and ``model.weights`` read. Every parameter comes from the graph and every
float constant of the graph is used, or nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from facenet.cli.common import add_threads_argument, check_outputs, run_command, set_threads
from facenet.errors import WeightsError
from facenet.files import open_regular
from facenet.inference.loading import TrainedModel, save_weights
from facenet.models.embedding import EmbeddingNet
from facenet.models.sandberg import MappingError, graph_state_dict
from facenet.models.tf_graph import GraphError, parse_graph

MAX_GRAPH_BYTES = 2**30


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-convert``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", metavar="SRC", help="sandberg's frozen graph (.pb)")
    parser.add_argument("out", metavar="DST", help="the weights file to write (.pt)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace this command's earlier output"
    )
    add_threads_argument(parser)
    return parser


def convert_graph(src) -> tuple[TrainedModel, int]:
    """The network a frozen graph holds, and its node count; WeightsError naming ``src``."""
    with open_regular(src, MAX_GRAPH_BYTES, lambda why: WeightsError(f"{src}: {why}")) as fh:
        buf = fh.read()
    try:
        nodes = parse_graph(buf)
        state, size = graph_state_dict(nodes)
    except (GraphError, MappingError) as err:
        raise WeightsError(f"{src}: {err}") from None
    dim = state["embedding.linear.weight"].shape[0]
    model = EmbeddingNet("inception_resnet_v1", dim)
    model.load_state_dict(state)
    architecture = {"backbone": "inception_resnet_v1", "embedding_dim": dim, "dropout": 0.0}
    return TrainedModel(model.eval(), size, "fixed", "weights", str(src), architecture), len(nodes)


def _convert(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    check_outputs(args)
    trained, count = convert_graph(args.src)
    params = sum(p.numel() for p in trained.model.parameters())
    save_weights(trained, args.out)
    print(
        f"read {args.src}: {count} nodes, {params:,} parameters; wrote {Path(args.out)} "
        f"(inception_resnet_v1, {trained.embedding_dim}-d embeddings, {trained.image_size} px, "
        f"fixed standardisation)"
    )


def main(argv: list[str] | None = None) -> int:
    """Convert; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _convert(args))


if __name__ == "__main__":
    sys.exit(main())
