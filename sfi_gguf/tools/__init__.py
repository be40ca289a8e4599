"""Benchmark and evaluation tooling, apart from the library: the library never imports it.

`bench` (`sfi-gguf bench`: decode speed, dense vs SFI), `evals/` (`sfi-gguf eval`: quality at equal
budget), `agreement` (teacher-forced agreement with dense), `random_model` (random-weight GGUFs of real
shapes, and tiny ones for tests), `texts` (natural text we can ship), `provenance` (the commit a result
came from). The CLI imports `bench` and `evals` only for their verbs.
"""
