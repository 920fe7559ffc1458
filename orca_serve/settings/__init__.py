"""A request's orca settings, defined once and read by both sides.

- `contract`: the words, defaults and types the server and the engine share (`StopReason`,
  `Policy`, the `vllm_xargs` names, `OrcaSettings`: what a request runs with, one frozen type for
  both sides; `OrcaResult`).
- `rules`: each client-settable setting's rule, applied by the HTTP check and by the engine.
- `field`: the request body's `orca` field (schema, checks, one-line 400s).
- `resolve`: a request's `OrcaSettings`, built once on the server from the body's field, the
  server's defaults and the bundle's (or the live audit's) lambda* (`resolve`).
- `xargs`: the one codec of `OrcaSettings` to and from `vllm_xargs` (`encode_settings` on the
  server; `decode_settings` and `on_deployment` in the engine), and their checks.
- `effort`: `reasoning_effort` as a calibrated risk level.
- `engine_config`: the plugin's engine config, `additional_config["orca"]`, one frozen
  `EngineConfig` on both sides.
"""
