"""orca-serve's vLLM adapters (vLLM 0.31-0.33, `config.SUPPORTED_VLLM`: the V1 model runner and
Model Runner V2).

- `config`: `engine_kwargs(bundle_path, record=...)`, `prepare_environment()`,
  `check_engine_supported(...)`, `log_with_vllm()` -- how a caller turns the plugin on.
- `processor`: `OrcaLogitsProcessor`, the custom logits processor of the V1 runner, and the one
  FQCN for both runners (built the MRV2 way, it returns the MRV2 adapter).
- `mrv2`: `OrcaMRV2LogitsProcessor`, the Model Runner V2 adapter.
- `adapter`: what both adapters share (the core built from vLLM's engine config, admission
  checks, joining requests, results; where the model runner comes from).
- `speculation`: the V1 runner under speculative decoding (n-gram, draft model).
- `worker`: `OrcaWorkerExtension` (`orca_results(keys)`, `orca_stats()` for `collective_rpc`;
  `orca_serve.settings.contract.merge_results` reads its answers).

The LM-head capture and everything the adapters read from vLLM's model runners beyond the
processor interfaces are in `orca_serve.vllm_compat` (`capture`, `runner`, `tokenizer`).
This package's `__init__` imports nothing from vLLM itself, so `config` works without loading
vLLM.
"""

from orca_serve.vllm_plugin.config import (  # noqa: F401
    PROCESSOR_FQCN,
    WORKER_EXTENSION,
    check_engine_supported,
    engine_kwargs,
    prepare_environment,
)
