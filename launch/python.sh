# Sourced by launch/torchrun.sh and launch/slurm.sbatch: which Python runs memplan, and steps that
# fail with their own error (not with a later step's, e.g. a JSONDecodeError on an empty output).

# find_python REPO: set PYTHON to $MEMPLAN_PYTHON, else REPO/.venv/bin/python (no need to activate it),
# else python3 on PATH; put REPO first on PYTHONPATH (this checkout's memplan, whatever the working
# directory); exit 3, naming the Python and the fix, when it lacks torch, pytorch_lightning or memplan.
find_python() {
    local repo="$1" chosen
    if [[ -n "${MEMPLAN_PYTHON:-}" ]]; then
        PYTHON="$MEMPLAN_PYTHON"; chosen="MEMPLAN_PYTHON ($MEMPLAN_PYTHON)"
    elif [[ -x "$repo/.venv/bin/python" ]]; then
        PYTHON="$repo/.venv/bin/python"; chosen="the project's Python ($PYTHON)"
    else
        PYTHON=python3; chosen="python3 on PATH (there is no $repo/.venv and MEMPLAN_PYTHON is not set)"
    fi
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    local problem status=0
    # find_spec looks the packages up without importing them (importing torch takes seconds)
    problem="$("$PYTHON" -c 'import importlib.util, sys
missing = [m for m in ("torch", "pytorch_lightning", "memplan") if importlib.util.find_spec(m) is None]
sys.exit(f"No module named {missing[0]!r}" if missing else 0)' 2>&1)" || status=$?
    if (( status != 0 )); then
        echo "$0: $chosen cannot run memplan: ${problem##*$'\n'}" >&2
        echo "$0: set MEMPLAN_PYTHON to a Python with torch and pytorch-lightning, or create the project's" \
             "environment: python3 $repo/scripts/install.py" >&2
        exit 3
    fi
}

# run_step WHAT COMMAND...: run COMMAND; when it fails, end the script with its exit status, naming WHAT.
run_step() {
    local what="$1" status=0
    shift
    "$@" || status=$?
    if (( status != 0 )); then
        echo "$0: $what failed (exit $status)" >&2
        exit "$status"
    fi
}
