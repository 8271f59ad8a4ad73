"""The command-line layer: one module per console command (``facenet-train``,
``facenet-evaluate``, ...), each a ``main(argv) -> exit code``, above every other layer.
``common`` holds what they share: the one error wrapper and the ``--device`` argument.
"""
