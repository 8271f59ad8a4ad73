"""``facenet-train`` (facenet.cli.train), run from a checkout."""

from facenet.cli.train import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
