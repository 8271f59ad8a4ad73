"""``facenet-make-synthetic`` (facenet.cli.make_synthetic), run from a checkout."""

from facenet.cli.make_synthetic import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
