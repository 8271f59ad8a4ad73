"""``facenet-identify`` (facenet.cli.identify), run from a checkout."""

from facenet.cli.identify import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
