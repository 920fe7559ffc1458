"""The one place that uses vLLM names outside vLLM's documented extension points.

One module per vLLM surface. Each says which vLLM releases it was checked against and lists, in
a module-level `TOUCH_POINTS` tuple, the "module.path:attr.path" names it relies on (or
alternatives joined by " | " where a name moved between supported releases: one must resolve),
so that a new vLLM can be checked before it is trusted: `orca-serve --check-vllm`
(`orca_serve/startup/vllm_check.py`) resolves them all (docs/PLUGIN.md, "vLLM versions and touch points").
Nothing outside this package imports a vLLM name that is not a documented extension point
(tests/test_vllm_compat.py enforces it).

- `capture`, `runner`, `speculation`, `tokenizer`: the engine side (the plugin's adapters).
- `launch`, `engine_client`: the server side (the launch, and the engine client's calls).
- `offline`: the calibration job's collector stepping vLLM's offline `LLM` itself.
"""
