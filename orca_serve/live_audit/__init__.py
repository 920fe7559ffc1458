"""The live audit's server side: sampling live requests, labelling them through the server's
engine, the guards' journalled state, the HTTP route and the Prometheus collector.

Its statistics (confidence sequences, drift, attrition, the guards' decisions) are the
method's, `orca_method/audit/`, which the offline tools run too. Docs: docs/AUDIT.md.
"""
