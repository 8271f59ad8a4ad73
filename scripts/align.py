"""``facenet-align`` (facenet.cli.align), run from a checkout."""

from facenet.cli.align import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
