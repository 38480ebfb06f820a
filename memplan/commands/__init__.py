"""The command line: one module per subcommand (estimate, suggest, devices, report, watch, validate), each with
`add_parser(subparsers)` and `run(args)`; cli.py registers them and maps errors to exit codes. What the
commands share or show lives beside them, named by what it does (args: flag checks; planning: suggest's
glue to the planner; measurement: validate's fresh process; plan_table, output, progress, run_logs, ...).

Nothing in memplan below this package imports from it."""
