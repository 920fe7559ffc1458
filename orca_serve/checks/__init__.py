"""Refusals on the way in, shared by start-up and hot reload: one line, naming the fix.

- `errors`: how orca-serve refuses to start (`StartupError`, exit code 2).
- `argtypes`: argparse converters for the CLIs' options, each with its one-line error.
- `bundle`: a bundle against the model it would serve (config.json and tokenizer, no weights)
  and against the options the server runs with.
"""
