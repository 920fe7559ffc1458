"""Admission: which requests the core tracks, and the Request a new one becomes (its settings,
deployment and policy, downgraded where forcing cannot work).

Kept out of `OrcaCore` (engine.py), which composes the parts; nothing here touches the device.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from orca_method.steps import Segmenter
from orca_serve.settings.contract import OrcaSettings, Policy, RequestDefaults, child_key
from orca_serve.core.deployment import Deployments
from orca_serve.core.registry import Request, open_reasoning_tokens
from orca_serve.core.stopping import guard_position
from orca_serve.settings.xargs import decode_settings, on_deployment

log = logging.getLogger("orca_serve.core")


class Admission:
    """The engine's request defaults and the rule that turns a request's settings into a
    `Request`."""

    MAX_LOGGED_NOTES = 64  # clients choose deltas: the set of logged refusals stays bounded

    def __init__(self, deployments: Deployments, defaults: RequestDefaults, *,
                 record_default: bool, default_eos: int | None,
                 give_up_ids: list[int] | None = None) -> None:
        self.deployments = deployments
        self.defaults = defaults
        self.give_up_ids = give_up_ids  # the "could not solve" message's ids (policy message)
        self.record_default = record_default
        self.default_eos = default_eos
        self._logged: set[str] = set()  # refusals the log has shown (a delta not in the table)

    def settings(self, xa: Mapping[str, Any] | None) -> OrcaSettings | None:
        """A request's settings, read once from its extra_args (`decode_settings`); None when
        the core does not track it (neither recorded nor asking for a bundle that scores)."""
        s = decode_settings(xa, self.defaults, record=self.record_default)
        if s.record or (s.enabled and (s.bundle is not None
                                       or self.deployments.current.bank is not None)):
            return s
        return None

    def new_request(self, ident: str, asked: OrcaSettings, *, prompt: Sequence[int] | None,
                    n_out: int, index: int, max_tokens: int | None, eos: int | None,
                    ignore_eos: bool, structured: bool) -> Request:
        """A request's settings on its deployment (`on_deployment`), its policy (downgraded
        where forcing cannot work)."""
        want = asked.bundle
        dep = self.deployments.current if want is None else self.deployments.get(want)
        missing = dep is None
        if missing:  # its lambda* belongs to a probe this engine no longer has: no early stop
            dep = self.deployments.current
        s = on_deployment(asked, self.defaults, lam_of=None if missing else dep.lam_of,
                          default_delta=None if missing else dep.default_delta,
                          groups=() if missing else dep.groups)
        policy, notes = s.policy, []
        if policy.rule.acts and not policy.rule.answers and ignore_eos:
            notes.append(f"policy {policy} under ignore_eos: a forced EOS would not end the "
                         "request, so it runs as shadow")
            policy = Policy.SHADOW
        if policy.rule.acts and structured:
            notes.append("structured output: forcing tokens would break the grammar, so it runs "
                         "as shadow")
            policy = Policy.SHADOW
        req = Request(ident, s, dep, Segmenter(dep.table, prompt, keep_ids=s.record),
                      index=index, key=None if s.key is None else child_key(s.key, index, s.n),
                      policy=policy, max_tokens=max_tokens,
                      eos=self.default_eos if eos is None else eos, ignore_eos=ignore_eos,
                      n_out=n_out)
        req.prompt_reasoning = open_reasoning_tokens(dep.table, prompt)
        req.give_up_ids = self.give_up_ids
        if missing:
            req.bundle_checksum = None
            req.fail(f"bundle {want} is not loaded in this engine (replaced before the request "
                     "started); it ran without early stopping")
        elif s.refused is not None:
            req.fail(f"{s.refused}; it ran without early stopping",
                     log_it=self._first_time(s.refused))
        req.notes += notes
        if n_out:
            req.notes.append(f"joined with {n_out} generated tokens; those are not pooled")
        if s.enabled:
            req.guard_pos = guard_position(policy, max_tokens=max_tokens, reserve=s.reserve,
                                           force_len=len(dep.force_ids),
                                           answer_budget=s.answer_budget)
        return req

    def _first_time(self, refusal: str) -> bool:
        """Whether to log a refusal (a delta outside the bundle's table: a request without the
        server, e.g. on a stock vLLM server, which cannot answer 400): once per distinct one,
        and a bounded set of them, since clients choose deltas."""
        if refusal in self._logged or len(self._logged) >= self.MAX_LOGGED_NOTES:
            return False
        self._logged.add(refusal)
        return True
