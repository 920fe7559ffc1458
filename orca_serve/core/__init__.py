"""The plugin's engine-step core, independent of vLLM's model runners.

- `engine`: `OrcaCore` (join/leave/step/pop_results), what every adapter drives; it composes:
- `admission`: which requests the core tracks, and the `Request` a new one becomes;
- `table`: the request table (join, park, evict, leave, stored results);
- `rows`: the row map both adapters feed (engine position -> tracked request);
- `plan`: the host half of a step (segmentation, budget guard, forced tokens) as one `StepPlan`;
- `device_step`: the device half (pooling, scoring, forcing) on preallocated memory;
- `pooling`: per-slot device memory, the per-step staging copy, readback and event fence;
- `registry`: a tracked request and the store of results (TTL, max count);
- `stopping`: forced-token plans of the policies and the budget guard;
- `deployment`: a bundle made ready for an engine (one per request, for hot reload);
- `gate_alarm`: the shift gate's alarm, one per deployment;
- `speculation`: accepted draft tokens fed through the core (speculative decoding).
"""
