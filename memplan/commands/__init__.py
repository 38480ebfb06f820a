"""The command line: one module per subcommand (suggest, estimate, validate, report/watch, devices) and cli.py.

Nothing in memplan below this package imports from it."""
