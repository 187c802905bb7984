"""JSON Schemas shipped with rnnfuse (package data, not code).

- `cli-output-v1.json`: the records `rnnfuse inspect|bench|check --json`
  print (see `rnnfuse.cli.output` and docs/api.md).
"""
