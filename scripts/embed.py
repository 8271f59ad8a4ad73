"""``facenet-embed`` (facenet.cli.embed), run from a checkout."""

from facenet.cli.embed import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
