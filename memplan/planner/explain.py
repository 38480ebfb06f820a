"""The plan in words: why the winner won, and why each runner-up did not."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memplan.checkpoint_setting import FULL, NONE
from memplan.estimator.result import MemoryEstimate
from memplan.plan import Plan
from memplan.planner.alternatives import alternatives
from memplan.planner.candidates import SPEED_TIE, Candidate, fastest
from memplan.planner.checkpoint_reasons import checkpoint_speed_reason
from memplan.planner.layout_reasons import strategy_reasons
from memplan.planner.reasons import GPUS_USED, Reason, no_checkpointing
from memplan.planner.request import PlanRequest
from memplan.planner.wording import (find_setting, format_seconds, layout_name, plural, precision_twin, same_setting,
                                     timing_fields, why_unfit)
from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.planner.search import _Search


def describe_plan(request: PlanRequest, winner: Candidate, est: MemoryEstimate, search: _Search) -> Plan:
    """The Plan for the verified winner, with reasons and alternatives."""
    indices = tuple(sorted(d.cuda_index for d in winner.devices if d.cuda_index is not None))
    return Plan(
        gpu_name=winner.devices[-1].name,
        gpus=indices if len(indices) == len(winner.devices) else (),
        nodes=request.nodes,
        world_size=winner.world_size,
        micro_batch_size=winner.micro_batch_size,
        accumulate_grad_batches=winner.accumulate_grad_batches,
        global_batch_size=request.global_batch_size,
        precision=winner.precision,
        gradient_checkpointing=bool(winner.checkpointing),
        checkpointing=winner.checkpointing,
        user_checkpointing=request.user_checkpointing,
        strategy="fsdp" if winner.sharding else ("ddp" if winner.world_size > 1 else "auto"),
        sharding_strategy=winner.sharding,
        cpu_offload=winner.offload,
        block_classes=request.block_classes if winner.sharding else (),
        predicted_peak_bytes=est.device_total,
        device_budget_bytes=winner.budget_bytes,
        host_bytes_per_rank=winner.host_bytes_per_rank,
        relative_speed=1.0,
        reasons=tuple(_reasons(request, winner, est, search)),
        alternatives=tuple(alternatives(winner, search)),
        **timing_fields(winner.timing),
        speed_reason=(checkpoint_speed_reason(winner, search, request.repeated_blocks)
                      or _speed_reason(winner, search)),
    )


def _rate(c: Candidate) -> str:
    """'tokens/s' when the batch has a sequence dimension, else 'samples/s'."""
    return "tokens/s" if c.timing is not None and c.timing.tokens_per_s is not None else "samples/s"


def runner_up(w: Candidate, search: _Search) -> Candidate | None:
    """The fastest fitting candidate that is not the winner or its bf16/16-mixed twin."""
    rivals = [c for c in search.candidates if search.fits(c) and c is not w
              and not precision_twin(c, w)]
    return fastest(rivals)


def _speed_reason(w: Candidate, search: _Search) -> str | None:
    """One line: why the plan beats the runner-up, by how much."""
    other = runner_up(w, search)
    if other is None or not other.speed:
        return None
    gain = w.speed / other.speed - 1
    if gain < SPEED_TIE:
        return (f"ties the runner-up ({_describe(other)}) on predicted speed ({_ms(w)} vs {_ms(other)} a step, "
                f"within {SPEED_TIE:.0%}); preferred for {_winner_edge(w, other)}.")
    return (f"{_winner_edge(w, other)}: {gain:+.0%} {_rate(w)} over the runner-up "
            f"({_describe(other)}; predicted step {_ms(w)} vs {_ms(other)}).")


def _ms(c: Candidate) -> str:
    return format_seconds(c.timing.step_seconds) if c.timing is not None else "?"


def _describe(c: Candidate) -> str:
    return (f"{plural(c.world_size, 'rank')}, micro-batch {c.micro_batch_size}, {c.precision}, "
            f"{c.checkpointing.describe()}, {c.group.strategy_label}")


def _winner_edge(w: Candidate, other: Candidate) -> str:
    """What the winner does that the runner-up does not, in a few words."""
    if other.checkpointing and not w.checkpointing:
        return "no recompute of the blocks' forward"
    if other.world_size < w.world_size:
        return f"{w.world_size} ranks instead of {other.world_size}"
    if other.world_size > w.world_size:
        return f"{plural(w.world_size, 'GPU')} instead of {other.world_size}"
    if other.micro_batch_size < w.micro_batch_size:
        fewer = " (fewer accumulation steps)" if w.accumulate_grad_batches < other.accumulate_grad_batches else ""
        return f"micro-batch {w.micro_batch_size} instead of {other.micro_batch_size}{fewer}"
    if other.group.amp and not w.group.amp:
        return "32-true"
    if w.group.amp and not other.group.amp:
        return f"{w.precision} on tensor cores"
    if layout_name(other) != layout_name(w):
        return f"{w.group.strategy_label} rather than {other.group.strategy_label}"
    if w.precision == "bf16-mixed" and other.precision == "16-mixed":
        return "bf16-mixed (no GradScaler)"
    if w.checkpointing != other.checkpointing:
        return w.checkpointing.describe()
    return "the predicted step time"


# --- reasons (a plan for CPU ranks speaks of devices, not GPUs: request.device_word) -------------------
def _reasons(request: PlanRequest, w: Candidate, est: MemoryEstimate, search: _Search) -> list[str]:
    device = request.device_word
    reasons = [
        f"{plural(w.world_size, 'rank')} ({plural(request.nodes, 'node')} x {plural(w.gpus_per_node, device)}) x "
        f"micro-batch {w.micro_batch_size} x {plural(w.accumulate_grad_batches, 'accumulation step')} = global batch "
        f"{request.global_batch_size}, kept exactly.",
        f"Predicted peak {format_bytes(est.device_total)} per {device}, traced at exactly this setting, within the "
        f"{format_bytes(w.budget_bytes)} budget ({format_bytes(w.devices[-1].free_bytes)} free on "
        f"{w.devices[-1].label} less the {request.margin:.0%} margin): {format_bytes(w.budget_bytes - est.device_total)} "
        f"headroom. {plural(search.calls, 'estimator trace')} in the search.",
        _micro_reason(request, w, search),
        _precision_reason(request, w, search),
        _checkpointing_reason(request, w, search),
        *strategy_reasons(request, w, search),
    ]
    reasons.extend(_left_out_reasons(request, w, search))
    return reasons


def _micro_reason(request: PlanRequest, w: Candidate, search: _Search) -> str:
    larger = sorted((c for c in search.candidates if same_setting(c, w, micro_batch_size=c.micro_batch_size)
                     and c.micro_batch_size > w.micro_batch_size), key=lambda c: c.micro_batch_size)
    if larger and search.fits(larger[0]):
        return (f"Micro-batch {w.micro_batch_size}: {larger[0].micro_batch_size} is predicted to fit too but was not "
                f"confirmed within the search's verification traces.")
    if larger:
        nxt = larger[0]
        return (f"Micro-batch {w.micro_batch_size} is the largest that fits: {nxt.micro_batch_size} "
                f"{why_unfit(search, nxt, request)}; {w.accumulate_grad_batches} accumulation steps keep the global batch.")
    if w.accumulate_grad_batches == 1:
        return (f"Micro-batch {w.micro_batch_size} is each rank's whole share of the global batch "
                f"({request.global_batch_size} / {w.world_size}): no accumulation needed.")
    return f"Micro-batch {w.micro_batch_size} is the largest allowed by max_micro_batch_size={request.max_micro_batch_size}."


def _precision_reason(request: PlanRequest, w: Candidate, search: _Search) -> str:
    amp = _amp_gain(w, search)
    if w.precision == "bf16-mixed":
        return f"bf16-mixed: {amp}, and bf16 needs no GradScaler (sm80+)."
    if w.precision == "16-mixed":
        if "bf16-mixed" not in request.precisions:
            return f"16-mixed: {amp}; bf16-mixed is not among the allowed precisions."
        old = sorted({d.label for d in request.devices if not d.bf16_supported})
        if old:
            lack = f"{old[0]} lacks" if len(old) == 1 else f"{', '.join(old)} lack"
            return f"16-mixed: {amp}; bf16-mixed needs compute capability 8.0+, which {lack}."
        return f"16-mixed: {amp}; bf16-mixed ranked lower here."
    if not any(p in request.precisions for p in ("bf16-mixed", "16-mixed")):
        return "32-true: the only precision allowed."
    amp_fits = [c for c in search.candidates if c.group.amp and search.fits(c)]
    if not amp_fits:
        return "32-true: no mixed-precision setting fits (nor a faster one)."
    return "32-true: it ranked above every mixed-precision setting that fits."


def _amp_gain(w: Candidate, search: _Search) -> str:
    """What AMP gains at the winner's setting, from the step-time model."""
    if not w.group.amp:
        return "AMP"
    fp32 = search.timed(dataclasses.replace(w, precision="32-true"))
    return (f"AMP runs matmuls at the half-precision peak: predicted {w.speed / fp32.speed:.2f}x the speed of "
            f"32-true at this setting")


def _recompute_cost(w: Candidate, search: _Search) -> str:
    """How much slower (or faster) the winner's setting runs with checkpointing flipped."""
    flipped = search.timed(dataclasses.replace(w, group=dataclasses.replace(
        w.group, checkpointing=NONE if w.checkpointing else FULL)))
    with_it, without = (w, flipped) if w.checkpointing else (flipped, w)
    return f"{1 - with_it.speed / without.speed:.0%} of the speed at this setting"


def _checkpointing_reason(request: PlanRequest, w: Candidate, search: _Search) -> str:
    if request.user_checkpointing:
        return (f"Keeps the model's own activation checkpointing ({request.user_checkpointing}), traced as it "
                "runs; memplan adds none on top.")
    if not w.checkpointing:
        if not request.allow_checkpointing:
            return no_checkpointing(request)
        return (f"No activation checkpointing: this setting fits without it, and recomputing each block's "
                f"forward would cost {_recompute_cost(w, search)}.")
    plain = find_setting(search, w, checkpointing=NONE)
    unckpt = [c for c in search.candidates if c.precision == w.precision and not c.checkpointing and search.fits(c)]
    if unckpt:
        best = max(unckpt, key=Candidate.rank_key)
        without = (f"the best setting (micro-batch {best.micro_batch_size} on {plural(best.world_size, 'rank')}) "
                   f"runs at {best.speed / w.speed:.0%} of this speed")
    elif plain is not None and (plain.group in search.explored or not search.possible(plain)):
        without = f"this setting {why_unfit(search, plain, request)}, and nothing without checkpointing fits"
    else:
        without = "nothing fits without it, not even at micro-batch 1"
    if w.checkpointing.mode in ("blocks", "op"):
        what = (f"the first {w.checkpointing.blocks} of {search.request.repeated_blocks} repeated blocks checkpointed, the "
                "fewest that fit (partial.py)" if w.checkpointing.mode == "blocks" else
                "each block keeps its matmul and attention outputs and recomputes the rest (torchtitan's op policy)")
        return f"{w.checkpointing.describe(search.request.repeated_blocks).capitalize()}: {what}; without it {without}."
    return f"Activation checkpointing on, at {_recompute_cost(w, search)}: without it {without}."


def _left_out_reasons(request: PlanRequest, w: Candidate, search: _Search) -> list[str]:
    """Why each GPU of the node that the plan does not use was left out."""
    usable = request.usable_device_indices(w.precision)
    reasons = []
    for i, d in enumerate(request.devices):
        if i not in usable:
            major, minor = d.compute_capability
            reasons.append(f"Left out {d.label}: {w.precision} needs compute capability 8.0+, it has {major}.{minor}.")
    unchosen = [i for i in usable if i not in w.device_indices]
    if not unchosen:
        return reasons
    floor = w.devices[-1].free_bytes
    for i in unchosen:
        d = request.devices[i]
        if d.free_bytes < floor:
            held = d.total_bytes - d.free_bytes
            reasons.append(
                f"Left out {d.label}: only {format_bytes(d.free_bytes)} free of {format_bytes(d.total_bytes)}"
                f"{f' (other processes hold {format_bytes(held)})' if held else ''}; using it would cap every "
                f"{request.device_word}'s budget at {format_bytes(request.budget_bytes(d.free_bytes))}.")
    reasons.append(Reason(f"Uses {w.gpus_per_node} of {len(usable)} {request.device_word}s per node: "
                          f"{_more_gpus(request, w, search, len(usable))}.", GPUS_USED))
    return reasons


def _more_gpus(request: PlanRequest, w: Candidate, search: _Search, available: int) -> str:
    """What stops each larger number of GPUs per node: the batch split, memory, host RAM or speed."""
    split, parts = [], []
    said = set()
    for gpus in range(w.gpus_per_node + 1, available + 1):
        with_it = [c for c in search.candidates if c.precision == w.precision and c.gpus_per_node == gpus]
        if not with_it:
            split.append(gpus * request.nodes)
            continue
        fitting = [c for c in with_it if search.fits(c)]
        if fitting:
            kind = "slower"
            best = max(fitting, key=Candidate.rank_key)
            text = (f"with {gpus} the best setting that fits (micro-batch {best.micro_batch_size}"
                    f"{', checkpointing' if best.checkpointing else ''}) runs at {best.speed / w.speed:.0%} of this speed")
        elif not any(c.group in search.explored for c in with_it):
            kind = "untraced"
            best = max(with_it, key=Candidate.rank_key)
            text = (f"with {gpus} no setting is predicted faster (at best {best.speed / w.speed:.0%} of this speed, "
                    "so it was not traced)")
        elif any(search.fits_device(c) for c in with_it):
            kind = "host"
            least = min(with_it, key=lambda c: c.host_bytes_per_rank)
            text = (f"host RAM stops {gpus}: {gpus} x {format_bytes(least.host_bytes_per_rank)} per node is over the "
                    f"{format_bytes(request.host_budget_bytes or 0)} host budget")
        else:
            kind = "memory"
            known = [search.predicted_bytes(c) for c in with_it if c.group in search.explored]
            need = f" (the least any needs: {format_bytes(min(known))})" if known else ""
            text = (f"with {gpus} nothing fits the {format_bytes(with_it[0].budget_bytes)} per-{request.device_word} "
                    f"budget{need}")
        if kind not in said:  # the smallest count of each kind says it; larger ones are alike
            said.add(kind)
            parts.append(text)
    if split:
        ranks = ", ".join(str(n) for n in split) if len(split) <= 6 else f"{split[0]}, {split[1]}, ... {split[-1]}"
        parts.append(f"the global batch {request.global_batch_size} does not split evenly over {ranks} ranks")
    return "; ".join(parts)

