"""The probe variants `orca-calibrate train --probe` and job files name (torch-free, so the CLI
can list them without importing the trainer)."""

# name -> ProbeSpec options
PROBES = {
    "static": {"online": False},
    "ttt-noqk": {},
    "ttt-qk": {"kind": "qk"},
    "ttt-qk-shared": {"kind": "qk", "shared_qk": True},
    "ttt-qk-ln": {"kind": "qk", "norm": "ln"},
    "ttt-qk-lnres": {"kind": "qk", "norm": "ln_res"},
    "ttt-qk-eta": {"kind": "qk", "eta_mode": "input"},
    "ttt-qk-mlp": {"kind": "qk", "mlp": True},
    "ttt-noqk-eta": {"eta_mode": "input"},
}
