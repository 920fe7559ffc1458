"""The live audit's statistics, apart from any server: is the calibrated guarantee holding?

Anytime-valid confidence sequences and the restarted, censored alarm (`sequence`), the
label-free drift tests (`drift`: the window test; `martingale`: the sequential one), which
finish reasons leave an audit's loss unknown (`attrition`) and the guards' decisions
(`guards`). Plain numpy/scipy and the method's own
modules: the server (`orca_serve/live_audit/`) runs them per request, the offline tools
(`orca-calibrate audit-report`, `recalibrate`) and the simulations run the same code.
Statistics: docs/AUDIT.md.
"""
