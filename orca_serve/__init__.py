"""orca-serve: calibrated early stopping of LLM reasoning (ORCA) inside vLLM."""

__version__ = "0.1.0"
