"""``facenet-make-pairs`` (facenet.cli.make_pairs), run from a checkout."""

from facenet.cli.make_pairs import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
