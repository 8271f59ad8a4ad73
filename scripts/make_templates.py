"""``facenet-make-templates`` (facenet.cli.make_templates), run from a checkout."""

from facenet.cli.make_templates import main

if __name__ == "__main__":  # guarded: spawned workers (align --workers) re-import it
    raise SystemExit(main())
