"""Wings: audit."""
