"""A request's orca settings, defined once and read by both sides.

- `contract`: the words and defaults the server and the engine share (`StopReason`, `Policy`,
  the `vllm_xargs` names, `OrcaResult`).
- `rules`: each client-settable setting's rule, applied by the HTTP check and by the engine.
- `field`: the request body's `orca` field (schema, checks, one-line 400s).
- `resolve`: a request's settings after the server's defaults and the bundle (`resolve`).
- `xargs`: the `vllm_xargs` codec the engine reads a request with (`request_spec`).
- `effort`: `reasoning_effort` as a calibrated risk level.
"""
