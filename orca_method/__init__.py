"""The ORCA method, shared by both sides: segmentation, the probe and its deployed procedure, the
bundle, the stopping rule and its loss, Learn-then-Test, trajectory files, answer probes and step
labels.

It imports nothing of vLLM and nothing of the serving side (`orca_serve`) or the offline job
(`orca_calibrate`); both of those import it (the layers are checked by import-linter, see
pyproject.toml).
"""
