"""Face alignment of photographs: the publishers' crop and landmark-template presets
(``presets``) and the aligner (``aligner``: MTCNN, imported only when aligning)."""
