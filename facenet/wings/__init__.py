"""Wings: optional features that the core (model, miners, losses, step, engine, loop, protocol)
and the run layer never import. A run or command loads one when it asks for it, through an
entry of :mod:`facenet.registry`, or a command imports it directly.

- ``publishers``: the publishers' networks, weight layouts and formats (facenet-pytorch's and
  MobileFaceNet's backbones and ports, sandberg's TensorFlow graphs, insightface ``.bin`` sets)
- ``templates``: IJB-style template verification (the meta-file reader and the protocol)
- ``demo``: the demo's synthetic identities
- ``align``: face alignment of photographs (MTCNN, landmark templates, the publishers' presets)
- ``after_training``: load a trained model, embed, identify, export, deployable thresholds
- ``retrieval``: Precision@1, R-Precision and MAP@R of an embedded folder
- ``audit``: a training set against an evaluation's images (overlap, label noise, identities
  filed twice) and an evaluation's worst errors as pictures
"""
