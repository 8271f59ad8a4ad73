"""``facenet-make-rec`` (facenet.cli.make_rec), run from a checkout."""

from facenet.cli.make_rec import main

if __name__ == "__main__":
    raise SystemExit(main())
