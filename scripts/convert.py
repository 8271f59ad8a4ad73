"""``facenet-convert`` (facenet.cli.convert), run from a checkout."""

from facenet.cli.convert import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
