"""orca-serve's vLLM adapters (vllm 0.32: the V1 model runner and Model Runner V2).

- `config`: `engine_kwargs(bundle_path, record=...)`, `prepare_environment()`,
  `check_engine_supported(...)` -- how a caller turns the plugin on.
- `processor`: `OrcaLogitsProcessor`, the custom logits processor of the V1 runner, and the one
  FQCN for both runners (built the MRV2 way, it returns the MRV2 adapter).
- `mrv2`: `OrcaMRV2LogitsProcessor`, the Model Runner V2 adapter.
- `adapter`: what both adapters share (admission checks, joining requests, results).
- `worker`: `OrcaWorkerExtension` (`orca_results(keys)`, `orca_stats()` for `collective_rpc`).

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

_ARRAY_TAG = "__orca_ndarray__"


def encode_arrays(result: dict) -> dict:
    """numpy arrays -> {tag, dtype, shape, data: bytes}: survives every collective_rpc transport.

    (vLLM's msgpack transport sends large numpy arrays out of band and, for an untyped RPC
    result, hands back only ['<f4', shape, <buffer index>]: the data would be lost.)
    """
    import numpy as np  # deferred: numpy (this package loads in every vLLM process)

    out = {}
    for k, v in result.items():
        if isinstance(v, np.ndarray):
            v = np.ascontiguousarray(v)
            v = {_ARRAY_TAG: 1, "dtype": v.dtype.str, "shape": list(v.shape), "data": v.tobytes()}
        out[k] = v
    return out


def decode_arrays(result: dict) -> dict:
    import numpy as np  # deferred: numpy (this package loads in every vLLM process)

    out = {}
    for k, v in result.items():
        if isinstance(v, dict) and v.get(_ARRAY_TAG):
            v = np.frombuffer(bytes(v["data"]), dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            v = v.copy()
        out[k] = v
    return out


def merge_results(per_worker: list[dict] | None) -> dict:
    """Merge `collective_rpc("orca_results", args=(keys,))` answers into {key: result},
    restoring `step_embeddings` as a float32 numpy array. Always use this on the raw RPC answer.

    `per_worker`: one dict per worker, from one engine or concatenated over data-parallel engines
    (a request runs on one engine, so its key comes from that engine's reporting worker only).
    Should two workers answer for one key, a result marked `ran_sampler` (its processor ran the
    sampler's apply(): the last pipeline stage) wins over one that is not; otherwise the first.
    """
    out: dict = {}
    for d in per_worker or []:
        for k, r in (d or {}).items():
            if r is None:
                continue
            if k not in out or (r.get("ran_sampler") and not out[k].get("ran_sampler")):
                out[k] = decode_arrays(r)
    return out
