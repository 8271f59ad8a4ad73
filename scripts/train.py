#!/usr/bin/env python
"""Train a FaceNet embedding: ``python scripts/train.py --config configs/<name>.yaml``.

The YAML file supplies the run; ``--set section.key=value`` overrides single keys.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from facenet.config import ConfigError, config_to_dict, load_config  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``train.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (value parsed as YAML); repeatable",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )
    parser.add_argument("--out", default=None, help="run directory (default: logging.out_dir)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from <out>/last.pt if it exists"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the process exit code (2 for a configuration mistake)."""
    args = get_args_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out is not None:
        cfg.logging.out_dir = args.out
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    from facenet.run import run_training

    return run_training(cfg, resume=args.resume)


if __name__ == "__main__":
    sys.exit(main())
