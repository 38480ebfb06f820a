#!/usr/bin/env bash
# One device-tool call (about 4 minutes) for what issue #22 left owed on a GPU after session 8:
#   - benchmarks.gpu_rules: cub sort storage and deterministic flash backward, read op by op against memplan's rules;
#   - the GPU campaign's part 1 (estimate on the GPU machine natively and emulated, truth by a real Trainer.fit) for
#     the accuracy cases the first H200 campaign was cut off before and the cuDNN RNN cases.
#   bash benchmarks/gpu_rules_run.sh OUT        (everything under OUT, packed into OUT/all.tgz at the end)
# Environment: ACCURACY_CASES (comma-separated), PART1_S (part 1's budget, default 220 s), SECTIONS (part 1's
# sections), JOBS / MEASURE_JOBS (estimate and GPU measurement processes at once, default 8 and 3).
set -u
out=${1:?usage: bash benchmarks/gpu_rules_run.sh OUT}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out/camp"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout 200 "$py" -m benchmarks.gpu_rules --out "$out" > "$out/gpu_rules.log" 2>&1 &
rules=$!
cases=${ACCURACY_CASES:-vit-b8-16mixed,mixer-b16-bf16mixed-ckpt,vit-b16,vit-b32-bf16mixed-ckpt,t5-b4,t5-b8-ckpt,bart-b4,bart-b4-bf16mixed,lstm-b32,lstm-b32-adagrad,gru-b32,gru-b32-bf16mixed,resnet18-b8}
part1_s=${PART1_S:-220}
timeout $((part1_s + 40)) "$py" -m benchmarks.gpu_campaign --part 1 --out "$out/camp" --budget-s "$part1_s" \
    --only "${SECTIONS:-cuda_overheads,accuracy_zoo,accuracy_extra}" --cases "$cases" \
    --jobs "${JOBS:-8}" --measure-jobs "${MEASURE_JOBS:-3}" > "$out/part1.out" 2>&1
wait "$rules"
tar czf "$out/all.tgz" -C "$out" --exclude all.tgz --exclude ./all.tgz .
