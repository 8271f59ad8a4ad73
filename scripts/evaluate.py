"""``facenet-evaluate`` (facenet.cli.evaluate), run from a checkout."""

from facenet.cli.evaluate import main

if __name__ == "__main__":  # guarded: the tests import this file as a module
    raise SystemExit(main())
