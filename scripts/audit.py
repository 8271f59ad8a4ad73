"""``facenet-audit`` (facenet.cli.audit), run from a checkout."""

from facenet.cli.audit import main

if __name__ == "__main__":  # guarded: the tests import this file as a module
    raise SystemExit(main())
