#!/usr/bin/env bash
# One device-tool call (about 4.5 minutes): the GPU campaign's part 1 (estimate natively and emulated on the GPU
# machine, truth by a real Trainer.fit) twice at once:
#   OUT/camp_exp  with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on 12 zoo cases (never measured before);
#   OUT/camp      at the default settings for the zoo cases gpu_rules_run.sh did not run (as many as the budget allows).
#   bash benchmarks/gpu_expandable_run.sh OUT
set -u
out=${1:?usage: bash benchmarks/gpu_expandable_run.sh OUT}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out/camp_exp" "$out/camp"
exp=${EXP_CASES:-mlp-b1024,cnn-b64-bf16mixed,resnet18-b16-sgd-momentum,gpt2-b8,gpt2-b8-bf16mixed-ckpt,llama-gqa-b2,mixtral-moe-b4,bert-b16-adam,t5-b8-ckpt,vit-b16,lstm-b32-adagrad,gru-b32}
rest=${REST_CASES:-gpt2-b4,gpt2-b8-ckpt,gpt2-b8-bf16mixed,llama-gqa-b4-bf16mixed,llama-gqa-b4-ckpt,llama-gqa-b2-bf16true,bert-b8,bert-b16-ckpt,mixer-b16,mixer-b16-bf16mixed,resnet18-b16-ckpt,resnet18-b16-bf16mixed,cnn-b32,cnn-b32-rmsprop,mlp-b64,mlp-b256-bf16mixed,mlp-b256-16mixed,mlp-b256-sgd-momentum-16true,linear-b64-sgd,mlp-b256-sgd}
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 270 "$py" -m benchmarks.gpu_campaign --part 1 \
    --out "$out/camp_exp" --budget-s "${PART1_S:-230}" --jobs 6 --measure-jobs 2 --only accuracy_zoo --cases "$exp" \
    > "$out/exp.out" 2>&1 &
expandable=$!
timeout 270 "$py" -m benchmarks.gpu_campaign --part 1 --out "$out/camp" --budget-s "${PART1_S:-230}" --jobs 6 \
    --measure-jobs 2 --only accuracy_zoo --cases "$rest" > "$out/rest.out" 2>&1
wait "$expandable"
