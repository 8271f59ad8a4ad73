#!/usr/bin/env python
"""Train a FaceNet embedding: ``python scripts/train.py --config configs/<name>.yaml``.

The YAML file supplies the run; ``--set section.key=value`` overrides single keys.

Exit codes: 0 done; 2 bad input (configuration, data, pairs file, checkpoint, output folder),
each reported on one line naming the key or the file; 3 a run of non-finite losses;
128 + N stopped by signal N (SIGINT 130, SIGTERM 143) after writing ``last.pt``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from facenet.config import add_override_argument, config_to_dict, load_config  # noqa: E402
from facenet.errors import ConfigError  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``train.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run configuration")
    add_override_argument(parser)
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
        help="start a new run even if <out>/last.pt exists (removing the previous run's "
        "checkpoints, logs, figures and TensorBoard events first)",
    )
    return parser


def _one_line(text: str) -> str:
    """A multi-line message (a YAML error quotes the line and a caret) as one line."""
    lines = [line.strip() for line in str(text).splitlines()]
    return " ".join(line for line in lines if line and set(line) != {"^"})


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as ``warning: <message>`` on stderr, without the source line."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the process exit code (2 for a configuration mistake)."""
    args = get_args_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    if args.out is not None:
        cfg.logging.out_dir = args.out
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.resume and args.overwrite:
        print("error: --resume and --overwrite exclude each other", file=sys.stderr)
        return 2
    from facenet.training.run import run_training

    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        return run_training(cfg, resume=args.resume, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
