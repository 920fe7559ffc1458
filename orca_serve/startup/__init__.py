"""orca-serve's start-up, from the command line to vLLM's running server.

- `cli`: the `orca-serve` entry point.
- `preflight`: options, the demo, the bundle and its checks, all before vLLM is imported.
- `vllm_setup`: vLLM's own parser over the command line, the plugin's engine arguments merged in.
- `ipc_dir`: vLLM's IPC sockets in a directory of the server's own, removed on exit.
- `vllm_check`: the installed vLLM still has every name orca-serve reaches.
- `demo`: `make demo` (serve the toy reasoner, ask it one question).
"""
