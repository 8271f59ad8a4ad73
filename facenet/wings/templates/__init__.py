"""IJB-B/C-style template verification: the meta files (``ijb``) and the protocol on templates
(``protocol``: media pooling, TAR at FAR)."""
