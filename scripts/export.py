"""``facenet-export`` (facenet.cli.export), run from a checkout."""

from facenet.cli.export import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
