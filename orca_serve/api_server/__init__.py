"""One API server process: vLLM's OpenAI app plus orca's routes, middleware and state.

- `server` / `endpoint_plugin`: the app, assembled once, in every API server process.
- `assembly` / `state`: the bundle, defaults, metrics, live audit and reloader around one
  immutable `Serving` that only a hot reload swaps.
- `middleware`, `apis`, `shaping`: a request's `orca` field in, its `orca` report out, per API.
- `report`: results fetched from the engine and the response's `orca` object.
- `voting`, `vote_stream`, `waves`: one voted answer from k samples (`orca.samples`), plain or
  streamed, its samples launched at once or in waves.
- `asgi`: the ASGI plumbing the middleware and the vote's sample requests share.
- `admin`, `reload`: hot reload (`POST /v1/orca/bundle`, SIGHUP).
- `log`, `quiet_shutdown`: the server's log lines.
"""
