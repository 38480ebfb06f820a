#!/usr/bin/env bash
# The whole GPU campaign in one device-tool call of under 10 minutes, ending on its own:
#   parts 1 and 3 side by side (every GPU process there reads only its own process's peaks), then part 2
#   (its OOM probe and largest-batch search fill the card) and part 4 (step times), each alone on the GPU.
#
#   bash benchmarks/gpu_campaign.sh OUT [gpu_campaign arguments, e.g. --dry-run]
#
# Budgets (seconds, each part stops starting work and kills its children at its own): PART1_S=270 PART3_S=150
# PART2_S=170 PART4_S=110: 550 s of parts in a row, the rest of the device tool's 600 s for each part's start-up.
# PYTHON (default python3) runs them. Exit status 0 when every section of every part finished, else 1.
# The background part is waited for by its own PID: never `pgrep -f "gpu_campaign --part 1"`, whose pattern
# also matches the shell running that very line (the first GPU call hung at its end on that).
set -u
out=${1:?usage: bash benchmarks/gpu_campaign.sh OUT [gpu_campaign arguments]}
shift
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
"$py" -m benchmarks.gpu_campaign --part 3 --out "$out" --budget-s "${PART3_S:-150}" "$@" >/dev/null 2>&1 &
part3=$!
"$py" -m benchmarks.gpu_campaign --part 1 --out "$out" --budget-s "${PART1_S:-270}" "$@" || status=1
wait "$part3" || status=1
"$py" -m benchmarks.gpu_campaign --part 2 --out "$out" --budget-s "${PART2_S:-170}" "$@" || status=1
"$py" -m benchmarks.gpu_campaign --part 4 --out "$out" --budget-s "${PART4_S:-110}" "$@" || status=1
exit "$status"
