"""Train a FaceNet embedding: ``facenet-train --config configs/<name>.yaml``.

``--set section.key=value`` overrides single keys. Exit codes: 0 done; 2 bad input, on one
line naming the key or the file; 3 a run of non-finite losses; 128 + N stopped by signal N
after writing ``last.pt``.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from facenet.cli.common import int_in, one_line_warnings, report_error
from facenet.config import add_override_argument, config_to_dict, load_config, max_threads
from facenet.errors import ConfigError, FacenetError
from facenet.files import check_not_inputs
from facenet.training.run import run_training


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run configuration")
    add_override_argument(parser)
    parser.add_argument(
        "--threads",
        type=int_in(0, max_threads()),
        metavar="N",
        help="same as --set train.threads=N (at most 4 per CPU core)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )
    parser.add_argument("--out", default=None, help="run directory (default: logging.out_dir)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from <out>/last.pt if it exists"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run even if <out>/last.pt exists (the previous run's recorded "
        "checkpoints, logs, figures and TensorBoard events are removed once every check passed)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run training; the process exit code."""
    args = get_args_parser().parse_args(argv)
    with one_line_warnings():  # an old configuration key's notice, the run's warnings
        try:
            if args.resume and args.overwrite:
                raise ConfigError("--resume and --overwrite exclude each other")
            threads = [] if args.threads is None else [f"train.threads={args.threads}"]
            cfg = load_config(args.config, args.overrides + threads)
            if args.out is not None:
                cfg.logging.out_dir = args.out
            check_not_inputs([cfg.logging.out_dir], {"--config": args.config})
        except FacenetError as err:
            return report_error(err)
        if args.print_config:
            print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
            return 0
        # run_training reports its own errors (one line naming the file or key).
        return run_training(cfg, resume=args.resume, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
