"""Training data that needs no download."""
