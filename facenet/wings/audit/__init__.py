"""Looking at the data (docs/audit.md): a training set audited against an evaluation's images,
and a verification's worst errors as a picture.

- ``embeddings``: both sets embedded once, with a cache keyed on the weights and the files
- ``neighbours``: exact nearest rows in chunks (the retrieval wing's operands)
- ``findings``: overlap, label noise and split identities in unit embeddings
- ``report``: the findings ranked, as TSV tables and contact sheets, and the verification
  without the shared identities
- ``sheets``: contact sheets of faces; ``pair_errors``: the worst false rejects and accepts

Import from the submodules: a name has one home.
"""
