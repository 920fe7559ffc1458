"""Is the calibrated guarantee holding on live traffic? Risk, confidence sequence, drift.

Plain numpy/scipy (no vLLM): the server imports it per request, the offline tools
(`orca-calibrate audit-report`, `recalibrate`) use the same code. Statistics: docs/AUDIT.md.
"""

from orca_method.risk import is_counted, request_loss, request_losses, table_losses
from orca_serve.live_audit.drift import DriftMonitor, build_reference, drift_statistics
from orca_serve.live_audit.sequence import ConfidenceSequence, RestartedAlarm

__all__ = ["ConfidenceSequence", "DriftMonitor", "RestartedAlarm", "build_reference",
           "drift_statistics", "is_counted", "request_loss", "request_losses", "table_losses"]
