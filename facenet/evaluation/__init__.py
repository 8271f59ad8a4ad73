"""Face verification: the LFW protocol (``protocol``), the settings and publishers' presets it runs
under (``presets``), embedding pairs in eval mode (``embedding``), ``verify`` of a model on pairs
or ``.bin`` sets (``verify``), and the way its figures are written (``report``, ``plots``).
Import from the submodules: the package re-exports nothing, so a name has one home.
"""
