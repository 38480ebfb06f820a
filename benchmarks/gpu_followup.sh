#!/usr/bin/env bash
# What the first GPU campaign (an H200, session 4) left owed, in one device-tool call of under 10 minutes:
#   phase 1: part 1's cut-off accuracy cases and the zoo's extra variants (with the CUDA overheads of this card)
#            beside part 5 (benchmarks.gpu_ops: the convolution grid, op-by-op allocator readings);
#   phase 2: part 2 alone (the OOM retry through a real CUDA OOM, plan vs bisection, callback overhead);
#   phase 3: part 4 alone (GPT-2 small's kernel profile, step times on this card).
#
#   bash benchmarks/gpu_followup.sh OUT [gpu_campaign arguments, e.g. --dry-run]
#
# Everything is written under OUT/camp and packed into OUT/campaign.tgz after each phase (the device tool returns
# at most 8 files, and a call cut short keeps the last pack). Budgets: PHASE1_S=200 PHASE2_S=160 PHASE4_S=130.
set -u
out=${1:?usage: bash benchmarks/gpu_followup.sh OUT [gpu_campaign arguments]}
shift
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
work="$out/camp"
mkdir -p "$work"
status=0
pack() { tar czf "$out/.campaign.tgz" -C "$work" . && mv "$out/.campaign.tgz" "$out/campaign.tgz"; }
cases=${ACCURACY_CASES:-mixer-b16-bf16mixed-ckpt,vit-b16,vit-b8-16mixed,vit-b32-bf16mixed-ckpt,t5-b4,t5-b8-ckpt,bart-b4,bart-b4-bf16mixed}
"$py" -m benchmarks.gpu_campaign --part 5 --out "$work" --budget-s "${PHASE1_S:-200}" --measure-jobs 2 "$@" \
    >/dev/null 2>&1 &
part5=$!
"$py" -m benchmarks.gpu_campaign --part 1 --out "$work" --budget-s "${PHASE1_S:-200}" \
    --only cuda_overheads,accuracy_zoo,accuracy_extra --cases "$cases,$("$py" -c \
    'from benchmarks.accuracy_gpu import extra_cases; print(",".join(extra_cases()))')" "$@" || status=1
wait "$part5" || status=1
pack
"$py" -m benchmarks.gpu_campaign --part 2 --out "$work" --budget-s "${PHASE2_S:-160}" "$@" || status=1
pack
"$py" -m benchmarks.gpu_campaign --part 4 --out "$work" --budget-s "${PHASE4_S:-130}" "$@" || status=1
pack
exit "$status"
