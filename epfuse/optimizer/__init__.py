"""The pass manager, the public API, the report, model I/O, verification and the CLI."""
