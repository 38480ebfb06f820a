#!/usr/bin/env bash
# Plan a config on this node, then train it under torchrun (one node).
#
#   launch/torchrun.sh CONFIG [-- extra LightningCLI args]
#   launch/torchrun.sh configs/mlp.yaml -- --trainer.max_steps=100
#
# With GPUs (memplan devices sees at least one through NVML):
#   1. memplan suggest CONFIG --output $MEMPLAN_OUTPUT_DIR/<stem>.planned.yaml --json
#      writes the planned config and <stem>.planned.plan.json (the plan the MemoryPlanner callback applies);
#   2. CUDA_VISIBLE_DEVICES is narrowed to the GPUs the plan chose (the plan's `gpus` are CUDA indices,
#      mapped through any CUDA_VISIBLE_DEVICES already set), and --trainer.devices to their count, since
#      the planned config names the chosen indices, which the narrowing renumbers 0..N-1;
#   3. torchrun --nproc-per-node=<plan world_size> --standalone -m memplan.train fit --config <planned.yaml>.
#
# Without GPUs (or MEMPLAN_CPU=1) -- the CPU path, and why:
#   memplan suggest plans for a GPU: its estimate adds CUDA context and allocator overheads and its budget
#   is a GPU's free memory. Planning CPU processes with `--gpu-memory <RAM per process>` would print a plan
#   for a device that does not exist, so this script does not plan ahead on CPU. It launches
#   MEMPLAN_CPU_PROCS gloo processes on the unplanned config with
#   --trainer.accelerator=cpu --trainer.devices=N, DDP or FSDP (below), and a MemoryPlanner callback
#   without a plan: at fit start it estimates the model on one real batch with the CPU estimator, budgets
#   from host RAM (within the cgroup limit, shared by the node's processes), plans on rank 0 for the
#   config's global_batch_size (its MemoryPlanner entry's init_args, which then is the callback used; or a
#   deprecated memplan: section's), and applies the same plan on every rank. No planned.yaml is written.
#   The strategy: --trainer.strategy=ddp, or, where the config's trainer.strategy names FSDP (FSDPStrategy,
#   ModelParallelStrategy, "fsdp") or MEMPLAN_CPU_STRATEGY=fsdp, Lightning's ModelParallelStrategy (FSDP2:
#   data_parallel_size=N, tensor_parallel_size=1; FSDPStrategy needs a GPU), which needs a model whose
#   configure_model applies fully_shard (memplan.demos' GPTLM and LlamaLM do). FSDP plans on GPUs need
#   nothing here: the planned config names the strategy and keeps the MemoryPlanner callback.
#
# Environment (all optional):
#   MEMPLAN_PYTHON      Python with torch and Lightning installed. Default: the project's .venv/bin/python
#                       (beside this script's launch/ folder, found from any working directory; no need
#                       to activate it), else python3 on PATH. This checkout's memplan comes first on
#                       PYTHONPATH; memplan runs as `$PYTHON -m memplan`, torchrun as `-m torch.distributed.run`.
#   MEMPLAN_GPUS        GPUs of this node the planner may use (memplan suggest --gpus; default: all visible).
#   MEMPLAN_OUTPUT_DIR  where the planned config and plan go (default: the current directory; Lightning
#                       writes lightning_logs/ to the current directory as usual).
#   MEMPLAN_CPU         1: take the CPU path even where GPUs are visible.
#   MEMPLAN_CPU_PROCS   gloo processes on the CPU path (default 2).
#   MEMPLAN_CPU_STRATEGY  ddp or fsdp on the CPU path (default: fsdp where the config's trainer.strategy
#                       names FSDP, else ddp).
#   OMP_NUM_THREADS     passed through; torchrun sets 1 when unset.
#
# One node only: torchrun's standalone rendezvous. Planning separately on several nodes could give them
# different plans; for several nodes use launch/slurm.sbatch, which plans once for all of them.
#
# Signals: the script ends as torchrun (exec), so a SIGTERM to it reaches torchrun, which stops every
# rank; a SIGTERM to one rank ends that rank at once (memplan.train) and torchrun stops the others.
#
# Exit status: torchrun's; 2 for a usage error; 3 when the Python cannot run memplan; the failing step's
# own status when a step before training fails (memplan suggest: 1 when nothing fits).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { echo "usage: $0 CONFIG [-- extra LightningCLI args]" >&2; exit 2; }

[[ $# -ge 1 && "$1" != "--" ]] || usage
CONFIG="$1"; shift
[[ -f "$CONFIG" ]] || { echo "$0: no such config: $CONFIG" >&2; exit 2; }
if [[ $# -gt 0 ]]; then
    [[ "$1" == "--" ]] || usage
    shift
fi
CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
source "$REPO/launch/python.sh"
find_python "$REPO"

run_torchrun() {  # NPROC, then train.py's arguments; the script becomes torchrun, its status the script's
    local nproc="$1"; shift
    exec "$PYTHON" -m torch.distributed.run --nproc-per-node="$nproc" --standalone -m memplan.train "$@"
}

GPU_COUNT=0
if [[ "${MEMPLAN_CPU:-0}" != 1 ]]; then
    DEVICES="$(run_step "memplan devices" "$PYTHON" -m memplan devices --json)"
    GPU_COUNT="$(run_step "reading memplan devices' output" "$PYTHON" -c \
        'import json, sys; print(len(json.load(sys.stdin)["gpus"]))' <<< "$DEVICES")"
fi
if [[ "$GPU_COUNT" -eq 0 ]]; then
    NPROC="${MEMPLAN_CPU_PROCS:-2}"
    [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "$0: MEMPLAN_CPU_PROCS must be a positive integer; got $NPROC" >&2; exit 2; }
    read -r GLOBAL_BATCH CONFIG_STRATEGY HAS_PLANNER <<< "$(run_step "reading $CONFIG" "$PYTHON" -c 'import sys, yaml
from memplan.config.placement import planner_entries
config = yaml.safe_load(open(sys.argv[1])) or {}
section = config.get("memplan") or {}  # deprecated: memplan reads it until memplan.config.placement.REMOVED_IN
strategy = (config.get("trainer") or {}).get("strategy") or ""
name = str(strategy.get("class_path", "") if isinstance(strategy, dict) else strategy)
fsdp = "fsdp" in name.lower() or name.endswith("ModelParallelStrategy")
has = bool(planner_entries(config.get("trainer")))
print(section.get("global_batch_size") or "-", "fsdp" if fsdp else "ddp", int(has))' "$CONFIG")"
    [[ "$GLOBAL_BATCH" != "-" ]] || GLOBAL_BATCH=""
    CPU_STRATEGY="${MEMPLAN_CPU_STRATEGY:-$CONFIG_STRATEGY}"
    case "$CPU_STRATEGY" in
        ddp) STRATEGY_ARGS=(--trainer.strategy=ddp) ;;
        fsdp) STRATEGY_ARGS=(--trainer.strategy=ModelParallelStrategy
                             --trainer.strategy.data_parallel_size="$NPROC" --trainer.strategy.tensor_parallel_size=1) ;;
        *) echo "$0: MEMPLAN_CPU_STRATEGY must be ddp or fsdp; got $CPU_STRATEGY" >&2; exit 2 ;;
    esac
    PLANNER_ARGS=()  # the config's own MemoryPlanner entry (its init_args: global_batch_size ...), else one added
    if [[ "$HAS_PLANNER" != 1 ]]; then
        PLANNER_ARGS=(--trainer.callbacks+=memplan.MemoryPlanner)
        [[ -z "$GLOBAL_BATCH" ]] || PLANNER_ARGS+=(--trainer.callbacks.global_batch_size="$GLOBAL_BATCH")
    fi
    echo "memplan: no GPU here; training on $NPROC CPU process(es) under $CPU_STRATEGY, MemoryPlanner planning" \
        "at fit start" >&2
    export CUDA_VISIBLE_DEVICES=""
    run_torchrun "$NPROC" fit --config "$CONFIG" --trainer.accelerator=cpu --trainer.devices="$NPROC" \
        "${STRATEGY_ARGS[@]}" "${PLANNER_ARGS[@]}" "$@"
fi

OUT_DIR="$(mkdir -p "${MEMPLAN_OUTPUT_DIR:-.}" && cd "${MEMPLAN_OUTPUT_DIR:-.}" && pwd)"
STEM="$(basename "${CONFIG%.*}")"
PLANNED="$OUT_DIR/$STEM.planned.yaml"
PLAN_JSON="$OUT_DIR/$STEM.planned.plan.json"
SUGGEST=(suggest "$CONFIG" --force --output "$PLANNED" --json)
[[ -z "${MEMPLAN_GPUS:-}" ]] || SUGGEST+=(--gpus "$MEMPLAN_GPUS")
run_step "memplan suggest (its output: $OUT_DIR/$STEM.suggest.log)" \
    "$PYTHON" -m memplan "${SUGGEST[@]}" > "$OUT_DIR/$STEM.suggest.log"
echo "memplan: planned $PLANNED (plan $PLAN_JSON; suggest output in $OUT_DIR/$STEM.suggest.log)" >&2

# "<CUDA_VISIBLE_DEVICES for the chosen GPUs> <processes>", from the plan file
LAYOUT="$(run_step "reading the plan $PLAN_JSON" "$PYTHON" -c 'import json, os, sys
plan = json.load(open(sys.argv[1]))
nodes, world, gpus = plan["nodes"], plan["world_size"], [int(i) for i in plan["gpus"]]
if nodes != 1:
    sys.exit(f"memplan: the plan is for {nodes} nodes; launch/torchrun.sh runs one")
if len(gpus) != world:
    sys.exit(f"memplan: the plan chose GPUs {gpus} for world size {world}; expected one index per rank")
given = os.environ.get("CUDA_VISIBLE_DEVICES")
names = [s.strip() for s in given.split(",")] if given else [str(i) for i in range(max(gpus) + 1)]
print(",".join(names[i] for i in gpus), world)' "$PLAN_JSON")"
read -r VISIBLE NPROC <<< "$LAYOUT"
export CUDA_VISIBLE_DEVICES="$VISIBLE"
echo "memplan: CUDA_VISIBLE_DEVICES=$VISIBLE, $NPROC process(es)" >&2
run_torchrun "$NPROC" fit --config "$PLANNED" --trainer.devices="$NPROC" "$@"
