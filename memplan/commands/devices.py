"""`memplan devices`: the GPUs (NVML) and host memory memplan sees, as a table or JSON (device_table.py).

Nothing here imports NVML, psutil or rich at import time (`memplan --help` stays fast); `run` loads them.
"""
from __future__ import annotations

import argparse
import json

from memplan.commands import args as arg


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("devices", help="the GPUs (NVML) and host memory memplan sees")
    p.add_argument("--json", action="store_true", help="print as JSON (bytes as ints)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.commands.device_table import devices_dict, devices_table
    from memplan.hardware import host_info, visible_gpus

    gpus, host = visible_gpus(), host_info()
    if args.json:
        print(json.dumps(devices_dict(gpus, host), indent=2))
    else:
        from memplan.commands.output import console as output_console

        output_console().print(devices_table(gpus, host))
    return arg.EXIT_OK
