"""The command line: one module per subcommand (estimate, suggest, devices, report, watch, validate), each with
`add_parser(subparsers)` and `run(args)`; cli.py registers them and maps errors to exit codes. What the
commands share or show lives beside them, named by what it does (args: flag checks; planning: suggest's
glue to the planner; measurement: validate's fresh process; device_table, plan_table, output, progress,
run_logs, ...). `memplan --help` imports every verb module, so a verb module imports nothing heavy at import
time (torch, rich, NVML, psutil, the run logs): its `run` does.

Nothing in memplan below this package imports from it."""
