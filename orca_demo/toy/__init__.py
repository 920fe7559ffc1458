"""Toy reasoning model (guess-and-check linear equations) embedded as orca-serve's default model."""
