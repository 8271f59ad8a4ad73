"""The console commands (``facenet-train``, ``facenet-evaluate``, ...), one module each with a
``main(argv) -> exit code``; ``common`` holds what they share."""
