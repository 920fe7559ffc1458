"""The plugin's engine-step core, independent of vLLM's model runners.

- `engine`: `OrcaCore` (join/leave/step/pop_results), what every adapter drives;
- `registry`: tracked requests and stored results (TTL, max count);
- `pooling`: preallocated per-slot device memory, the per-step staging copy and readback;
- `stopping`: forced-token plans of the policies and the budget guard;
- `deployment`: a bundle made ready for an engine (one per request, for hot reload).
"""
