"""The plugin's engine config, `additional_config["orca"]`: one frozen object on both sides.

The server (`orca_serve.startup.vllm_setup`) and offline callers (`engine_kwargs`) build an
`EngineConfig`; vLLM carries its wire form (`to_dict`, JSON: `--additional-config` takes it as
text) to every worker, where the plugin reads it back with `from_dict` before the core is built
(`orca_serve.vllm_plugin.adapter`). Between those two boundaries it is this object, never a
dict. Plain Python (no vLLM, no torch): vLLM's front end and the CLIs read it cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from orca_method.normalizations import DEFAULT_NORMALIZATION, NORMALIZATIONS, Normalization
from orca_serve.settings.contract import DEFAULTS, MAX_RESULTS, RESULT_TTL_S, RequestDefaults

KEY = "orca"  # its key in vLLM's `additional_config`


@dataclass(frozen=True)
class EngineConfig:
    """What the plugin runs with in every worker of one engine."""

    bundle: str | None = None  # the bundle's absolute path (None: record mode only, no probe)
    record: bool = False  # the default of the per-request `orca_record`
    # record mode without a bundle: how steps are cut and pooled (the fields of the bundle's
    # Segmentation and ThinkTags; None: theirs); with a bundle the bundle's settings win
    segmentation: Mapping[str, Any] | None = None
    think: Mapping[str, Any] | None = None
    normalization: Normalization = DEFAULT_NORMALIZATION
    defaults: RequestDefaults = DEFAULTS
    result_ttl_s: float = RESULT_TTL_S  # how long an unfetched result is kept
    max_results: int = MAX_RESULTS  # and how many at most

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, "
                             f"got {self.normalization!r}")
        object.__setattr__(self, "normalization", Normalization(self.normalization))

    def to_dict(self) -> dict[str, Any]:
        """The wire form vLLM carries (JSON)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["defaults"] = self.defaults.to_dict()
        for name in ("segmentation", "think"):
            d[name] = None if d[name] is None else dict(d[name])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> EngineConfig:
        """From the wire form: missing keys take their defaults; an unknown key is a ValueError
        naming it (a misspelt setting would otherwise be served silently as its default)."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"additional_config[{KEY!r}]: unknown keys {', '.join(unknown)} "
                             f"(known: {', '.join(f.name for f in fields(cls))})")
        if "defaults" in d:
            d["defaults"] = RequestDefaults.from_dict(d["defaults"])
        for name, kind in (("record", bool), ("result_ttl_s", float), ("max_results", int)):
            if name in d:
                d[name] = kind(d[name])
        if d.get("normalization") is None:
            d.pop("normalization", None)
        return cls(**d)
