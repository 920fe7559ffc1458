"""The engine's tokenizer, as vLLM builds it for a model config.

Checked against vLLM 0.31 and 0.32 (engine tests, CPU build) and 0.33 (its source: the same
function, exported by `vllm.tokenizers`).

Why private: the plugin's core needs the tokenizer the engine uses (to encode step delimiters,
think tags and the forced text exactly as the model sees them, `tokenizer_mode` included), and
a logits processor is handed only the `VllmConfig`. When vLLM's function is missing or fails,
the tokenizer is loaded with transformers from the same config fields.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

TOUCH_POINTS: tuple[str, ...] = (
    "vllm.tokenizers:cached_tokenizer_from_config",
)


def load_tokenizer(model_config: Any) -> Any:
    """The tokenizer of `model_config` (a vLLM `ModelConfig`)."""
    try:
        from vllm.tokenizers import cached_tokenizer_from_config  # deferred: vllm (resolved at use)

        return cached_tokenizer_from_config(model_config)
    except Exception as e:  # noqa: BLE001 - fall back to transformers
        log.debug("vLLM's tokenizer loader failed (%s); loading with transformers", e)
        from transformers import AutoTokenizer  # deferred: transformers (the fallback only)

        return AutoTokenizer.from_pretrained(model_config.tokenizer,
                                             revision=model_config.tokenizer_revision,
                                             trust_remote_code=model_config.trust_remote_code)
