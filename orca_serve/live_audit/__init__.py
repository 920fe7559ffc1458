"""The live audit's server side: sampling live requests, labelling them through the server's
engine, the guards' journalled state, the HTTP route and the Prometheus collector.

Its statistics (confidence sequences, drift, attrition, the guards' decisions) are the
method's, `orca_method/audit/`, which the offline tools run too. Docs: docs/AUDIT.md.

- `options`, `factory`: the `--orca-audit-*` options and the audit built from them.
- `live`: from a request's admission to its labels; `sampling` picks the audited requests,
  `labeller` labels them through the server's engine, `store` writes them out.
- `state`, `journal`, `redis_journal`, `fleet`: the guards' state as a fold of journalled
  events, on disk or on a fleet's shared store.
- `votes`: the vote's audit (`orca.samples`).
- `handover`: a hot reload's new audit taking over from the old one.
- `route`, `collector`, `guard_log`: GET /v1/orca/audit, the Prometheus metrics, the log lines.
"""
