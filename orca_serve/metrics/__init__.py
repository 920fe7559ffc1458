"""orca's Prometheus metrics.

- `prometheus`: the metrics on orca-serve's `/metrics` (requests and engine).
- `stock`, `snapshots`: the same engine metrics on a stock vLLM server, through vLLM's plugins.
"""
