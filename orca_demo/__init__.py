"""The two embedded reasoners' makings: task generators, trainers, evaluations and the demo
bundles' builder (`toy/`, `long/`). Their weights and bundles ship with the server, in
`orca_serve/demo/`, which `orca-serve --demo` serves; this package is what made them."""
