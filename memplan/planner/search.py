"""make_plan: the fastest setting that fits, found with few traces.

Each estimator call is a trace of one training step (1-2 s for a GPT-2), so the search never traces
every candidate. It relies on five facts about a training step's memory:

1. AMP precisions share memory. bf16-mixed and 16-mixed keep fp32 weights and optimizer state and
   save half-precision activations; they differ by the GradScaler's two scalars. One AMP trace
   (16-mixed when allowed: the larger of the two) serves both; the winner is verified in its own.
2. DDP's per-rank memory does not depend on the number of ranks, except for the gradient buckets
   (one gradient's worth, the same for any world size > 1) and NCCL's buffers (outside the
   allocator). DDP candidates are traced at world_size=2 with NCCL's bytes removed, and
   `nccl_buffer_bytes(world_size)` is added back per world size; one-GPU candidates are traced at
   world_size=1 (no buckets, no NCCL).
3. Memory is linear in the micro-batch (activations and batch grow with it; weights, gradients and
   optimizer state do not), up to the caching allocator's rounding. Each group (see candidates.py)
   is traced at micro-batch 1 and PROBE_MICRO; the line through them predicts larger micro-batches,
   plus SAFETY_BYTES for the allocator's segments. Its slope is at least the growth of saved
   activations and of each phase's own peak (forward, backward, optimizer step): the peak is the
   largest of the phases' peaks, and the phase holding it at small micro-batches (the optimizer
   step, or the forward) is often not the one that grows fastest (the backward, with a language
   model's logits and their gradient), so the steepest phase's slope predicts the larger ones.
   A group whose sibling (same precision and checkpointing, other world kind or data-parallel
   layout: DDP, one GPU, the FSDP layouts) has a slope reuses
   it and is traced at micro-batch 1 only.
4. Less memory: checkpointing <= none, AMP <= 32-true, one rank <= DDP. A group that does not fit at
   micro-batch 1 rules out every group needing no less (on budgets no larger) without a trace.
5. Lower bounds (floors.py): the resident training state, the saved activations and (SHARD_GRAD_OP)
   the gathered parameters are all alive at the end of the forward. A candidate whose bound, from
   the parameter bytes or from traces of other groups, is over its budget is never traced, and a
   group with no such candidate left is never explored: DDP for a model whose weights no GPU holds.

Groups are explored best-first by the fastest candidate they could hold (costs.py); a group whose
best cannot beat the best fit found so far is never traced. The best candidate is then traced
exactly at its setting and the measurement joins its curve: if it does not fit, the chord through
it is conservative for a convex curve and the search resumes lower; if it fits, a larger
micro-batch that the refined line now admits is traced next (at most MAX_VERIFICATIONS such
traces). The plan's peak is always a trace at exactly the chosen setting.

A request that leaves only the micro-batch and checkpointing to choose (a Trainer's: its world size and
precision) traces its dominant candidate first, the largest micro-batch without checkpointing: 1 call
when it fits. Otherwise, calls: 3-5 when AMP without checkpointing fits (2 for the group, 1-3 to verify); 6-8 when
checkpointing or a single-GPU setting competes; at most 12 plus verifications with every group
traced. When nothing fits, 1 call per group until the frugal ones fail (4 with all allowed), and
NoFit is raised.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol

from memplan.checkpoint_setting import NONE, Checkpointing
from memplan.estimator.cuda.overheads import nccl_buffer_bytes
from memplan.estimator.result import MemoryEstimate
from memplan.plan import Plan
from memplan.planner.candidates import Candidate, Group, enumerate_candidates, fastest
from memplan.planner.costs import StepSetting, predict_step
from memplan.planner.explain import describe_plan
from memplan.planner.floors import Floors
from memplan.planner.memory_curve import MemoryCurve
from memplan.planner.nofit import NoFit, no_fit_error
from memplan.planner.partial import partial_checkpointing
from memplan.planner.profile import CostProfile
from memplan.planner.request import PlanRequest

PROBE_MICRO = 4
"""Second micro-batch traced per group (with 1) to fit the memory line."""
MAX_VERIFICATIONS = 3
"""Exact traces of the best candidate before settling for the best one that fit; a search that
has found none that fits keeps shrinking past it."""
EXPLORE_MARGIN = 0.02
"""A group is traced only when its best candidate could beat the best fit so far by more than this fraction
of predicted speed: closer than the step-time model can tell (benchmarks/results/published_throughput.md),
and not worth a trace."""
class Estimator(Protocol):
    """Per-GPU memory of one training step at a setting (memplan.estimate with the model bound).
    `checkpointing` is False / True for none / full, a memplan Checkpointing for the
    others ('op', 'blocks:K': only for a request with repeated_blocks). `fsdp` (an estimator.fsdp.FsdpSettings) is passed only for FSDP candidates: an estimator for a
    search without FSDP (PlanRequest.searches_fsdp False) need not accept it. An estimator may also
    have `prefetch(**setting)` (a trace that may be asked for next: it may start it now, see
    planner/background.py) and `cancel(**setting)` (drop that one, or with no setting all of them)."""

    def __call__(self, *, micro_batch_size: int, precision: str, checkpointing: bool | Checkpointing,
                 world_size: int, **fsdp) -> MemoryEstimate: ...


def _slowest(devices) -> str:
    """The GPU that sets the pace of a step over `devices`: the one of least dense half-precision peak."""
    from memplan.hardware.catalog import gpu_links

    return min(devices, key=lambda d: gpu_links(d.name).dense_half_flops).name


def _dominant(request: PlanRequest, candidates: list[Candidate]) -> Candidate | None:
    """The candidate no other can beat, traced first: with the world size and the precision fixed and no
    FSDP layouts to weigh (a Trainer's own request: all_devices, one precision), the candidates differ only
    in micro-batch and checkpointing, and the largest micro-batch without checkpointing (fewest
    accumulation steps, no recompute) is the fastest. Where its trace fits and the step-time model built
    from that trace agrees, it is the plan: one trace, so a Trainer's training_step runs as few times as
    planning needs. None where the request leaves more to choose."""
    if request.searches_fsdp or len({(c.world_size, c.precision) for c in candidates}) != 1:
        return None
    plain = [c for c in candidates if not c.checkpointing]
    return max(plain, key=lambda c: c.micro_batch_size) if plain else None


class _OwnCheckpointing(Exception):
    """A trace found the model calling torch.utils.checkpoint inside its forward, which the request did
    not know (it leaves no mark on the modules): plan again, keeping it and adding none of memplan's."""

    def __init__(self, calls: int, traces: dict[tuple, MemoryEstimate]) -> None:
        super().__init__(calls)
        self.calls, self.traces = calls, traces


class _Search:
    def __init__(self, request: PlanRequest, estimator: Estimator,
                 known: dict[tuple, MemoryEstimate] | None = None) -> None:
        self.request = request
        self.estimator = estimator
        self.known = known or {}
        """Traces made by an earlier search of the same request (_OwnCheckpointing), reused."""
        self.traces: dict[tuple, MemoryEstimate] = {}
        self.floors = Floors(request.parameter_bytes, request.optimizer_state_bytes)
        self.calls = 0
        candidates = list(enumerate_candidates(request))
        dominant = _dominant(request, candidates)
        first = self.trace(*dominant.trace_key) if dominant is not None else None
        settles = (first is not None and first.step_costs is not None and dominant.host_fits
                   and first.device_total <= dominant.budget_bytes)
        if settles:  # its own trace gives the step-time model: no trace at micro-batch 1 and PROBE_MICRO
            self.base = dominant.group
            self.profile = CostProfile(first.step_costs, low_micro=dominant.micro_batch_size, traced_amp=dominant.group.amp,
                                       parameter_count=request.parameter_count or first.num_parameters,
                                       tokens_per_sample=request.tokens_per_sample)
        else:
            self.profile = self.cost_profile(candidates)
        self.candidates = [self.timed(c) for c in candidates]
        self.groups: dict[Group, list[Candidate]] = {}
        for c in self.candidates:
            self.groups.setdefault(c.group, []).append(c)
        self.curves: dict[Group, MemoryCurve] = {g: MemoryCurve() for g in self.groups}
        for g, curve in self.curves.items():
            # Activations grow alike under every layout: the other world kind first, then the rest.
            kin = [h for h in self.curves if h != g and (h.amp, h.checkpointing) == (g.amp, g.checkpointing)]
            kin.sort(key=lambda h: (h.sharding is not None, h.multi == g.multi))
            curve.siblings = tuple(self.curves[h] for h in kin)
        self.explored: set[Group] = set()
        self.unfit: set[Group] = set()
        self.settled: Candidate | None = None
        """The dominant candidate (_dominant) where its trace fits and the step-time model ranks it first."""
        if first is not None:
            self.curves[dominant.group].add(dominant.micro_batch_size, first)
        if settles:
            self.explored.add(dominant.group)
            top = max(self.candidates, key=lambda c: c.rank_key())
            if top.trace_key == dominant.trace_key:
                self.settled = top
                return
        self.explore(self.base)  # the group the step-time model was traced on: its traces are made

    # --- the step-time model ---------------------------------------------------------------------
    def cost_profile(self, candidates: list[Candidate]) -> CostProfile:
        """The model's step costs (profile.py) from the traces of one group: AMP where allowed, no
        checkpointing, DDP (else one GPU, else FSDP; a layout whose lower bound fits first), at micro-batch 1
        and PROBE_MICRO (when micro-batch 1 fits): the traces the search makes first for that group anyway."""
        groups = {c.group for c in candidates}
        amp = any(g.amp for g in groups)
        pool = [g for g in groups if g.amp == amp and not g.checkpointing]
        possible = {c.group for c in candidates if c.group in pool and self.possible(c)}  # floors.py, no trace
        base = max(pool, key=lambda g: (g in possible, g.sharding is None, g.multi, not g.offload,
                                        g.sharding == "FULL_SHARD"))
        self.base = base
        own = [c for c in candidates if c.group == base]
        largest = max(c.micro_batch_size for c in own)
        precision, layout = self.trace_precision(base), (base.sharding, base.offload)
        probe = min(PROBE_MICRO, largest) if largest > 1 else None
        if probe is not None:
            self.prefetch(probe, precision, NONE, base.probe_world_size, *layout)
        low = self.trace(1, precision, NONE, base.probe_world_size, *layout)
        high = None
        if probe is not None and low.device_total <= max(c.budget_bytes for c in own):
            high = self.trace(probe, precision, NONE, base.probe_world_size, *layout)
        elif probe is not None:
            self.cancel_prefetch(probe, precision, NONE, base.probe_world_size, *layout)
        request = self.request
        parameters = request.parameter_count or low.num_parameters
        if low.step_costs is None:  # an estimator that does not count costs
            return CostProfile.from_parameters(parameters, tokens_per_sample=request.tokens_per_sample, amp=amp)
        return CostProfile(low.step_costs, high=high.step_costs if high is not None else None,
                           high_micro=probe or 0, traced_amp=amp, parameter_count=parameters,
                           tokens_per_sample=request.tokens_per_sample)

    def timed(self, c: Candidate) -> Candidate:
        """The candidate with its predicted step time (costs.predict_step) and speed."""
        timing = predict_step(self.profile, StepSetting(
            precision=c.precision, checkpointing=c.checkpointing, micro_batch_size=c.micro_batch_size,
            accumulate_grad_batches=c.accumulate_grad_batches, world_size=c.world_size, gpus_per_node=c.gpus_per_node,
            nodes=self.request.nodes, sharding=c.sharding, offload=c.offload, gpu_name=_slowest(c.devices),
            largest_block_bytes=self.request.largest_block_bytes))
        return dataclasses.replace(c, speed=timing.samples_per_s, timing=timing)

    # --- estimator calls ------------------------------------------------------------------------
    def setting(self, micro: int, precision: str, checkpointing: Checkpointing, world_size: int,
                sharding: str | None = None, offload: bool = False) -> dict:
        """The estimator's keyword arguments for a trace key."""
        extra = {}
        if sharding is not None:
            from memplan.estimator.fsdp import FsdpSettings

            shard_size = world_size // self.request.nodes if sharding == "HYBRID_SHARD" else None
            extra["fsdp"] = FsdpSettings(sharding_strategy=sharding, shard_size=shard_size, cpu_offload=offload)
        # none and full go as False / True, what estimators took before settings; the rest as the setting
        arg = bool(checkpointing) if checkpointing.mode in ("none", "full") else checkpointing
        return dict(micro_batch_size=micro, precision=precision, checkpointing=arg, world_size=world_size, **extra)

    def trace(self, micro: int, precision: str, checkpointing: Checkpointing, world_size: int,
              sharding: str | None = None, offload: bool = False) -> MemoryEstimate:
        key = (micro, precision, checkpointing, world_size, sharding, offload)
        if key not in self.traces:
            setting = self.setting(*key)
            if key in self.known:
                self.traces[key] = self.known[key]
            else:
                self.calls += 1
                self.traces[key] = self.estimator(**setting)
            calls = getattr(self.traces[key], "own_checkpoint_calls", 0)
            if calls and self.request.user_checkpointing is None:
                raise _OwnCheckpointing(calls, {**self.known, **self.traces})
            shard_size = getattr(setting.get("fsdp"), "shard_size", None)  # HYBRID_SHARD's, else None
            self.floors.add(micro_batch_size=micro, precision=precision, checkpointing=checkpointing,
                            world_size=world_size, sharding=sharding, offload=offload, est=self.traces[key],
                            shard_degree=shard_size or world_size)
        return self.traces[key]

    def prefetch(self, *key) -> None:
        """Tell an estimator that can trace in the background (background.py) what comes next."""
        prefetch = getattr(self.estimator, "prefetch", None)
        if prefetch is not None and tuple(key) not in self.traces:
            prefetch(**self.setting(*key))

    def cancel_prefetch(self, *key) -> None:
        """Drop the prefetched trace of `key`, or with no key every one."""
        cancel = getattr(self.estimator, "cancel", None)
        if cancel is not None:
            cancel(**(self.setting(*key) if key else {}))

    def trace_precision(self, group: Group) -> str:
        if not group.amp:
            return "32-true"
        # bf16-mixed and 16-mixed have the same memory but for the GradScaler's scalars: trace one
        # AMP precision for both, 16-mixed where allowed (the larger, and valid on every GPU).
        return "16-mixed" if "16-mixed" in self.request.precisions else "bf16-mixed"

    # --- memory of a candidate ------------------------------------------------------------------
    def predicted_bytes(self, c: Candidate) -> int:
        exact = self.traces.get(c.trace_key)
        if exact is not None:
            return exact.device_total
        curve = self.curves[c.group]
        value = curve.predict(c.micro_batch_size)
        if c.world_size > 1 and curve.has_communication:
            value += nccl_buffer_bytes(c.world_size, compute_capability=c.compute_capability)
        return value

    def fits_device(self, c: Candidate) -> bool:
        return c.group in self.explored and self.possible(c) and self.predicted_bytes(c) <= c.budget_bytes

    def possible(self, c: Candidate) -> bool:
        """Whether the candidate's lower bound (floors.py) is within its budget: one that is not can be
        ruled out without a trace."""
        return self.floors.floor(c) <= c.budget_bytes

    def fits(self, c: Candidate) -> bool:
        return c.host_fits and self.fits_device(c)

    # --- the search -----------------------------------------------------------------------------
    def bound(self, group: Group) -> tuple | None:
        """The best rank_key a candidate of the group could have if memory allowed; None if none fits
        the host or has a lower bound within its budget."""
        keys = [c.rank_key() for c in self.groups[group] if c.host_fits and self.possible(c)]
        return max(keys) if keys else None

    def ruled_out(self, group: Group) -> bool:
        top = max(c.budget_bytes for c in self.groups[group])
        return any(group.needs_no_less_than(u) and top <= max(c.budget_bytes for c in self.groups[u])
                   for u in self.unfit)

    def explore(self, group: Group) -> None:
        self.explored.add(group)
        curve, precision = self.curves[group], self.trace_precision(group)
        layout = (group.sharding, group.offload)
        largest = max(c.micro_batch_size for c in self.groups[group])
        probe = min(PROBE_MICRO, largest) if largest > 1 and curve.sibling_slope() is None else None
        if probe is not None:  # needed unless micro-batch 1 does not fit: start it beside the first
            self.prefetch(probe, precision, group.checkpointing, group.probe_world_size, *layout)
        curve.add(1, self.trace(1, precision, group.checkpointing, group.probe_world_size, *layout))
        if not any(self.fits_device(c) for c in self.groups[group] if c.micro_batch_size == 1):
            self.unfit.add(group)
            if probe is not None:
                self.cancel_prefetch(probe, precision, group.checkpointing, group.probe_world_size, *layout)
            return
        if probe is not None:
            curve.add(probe, self.trace(probe, precision, group.checkpointing, group.probe_world_size, *layout))

    def best_fit(self) -> Candidate | None:
        fitting = [c for c in self.candidates if self.fits(c)]
        return fastest(fitting)

    def next_group(self, best: Candidate | None) -> Group | None:
        """The unexplored group whose best candidate could beat `best` by more than EXPLORE_MARGIN."""
        floor = None if best is None else math.log(best.speed * (1 + EXPLORE_MARGIN)) if best.speed > 0 else -math.inf
        pending = [(b, g) for g in self.groups if g not in self.explored and not self.ruled_out(g)
                   and (b := self.bound(g)) is not None
                   and (best is None or (b > best.rank_key() and b[0] > floor))]
        return max(pending, key=lambda item: item[0])[1] if pending else None

    def run(self) -> tuple[Candidate, MemoryEstimate]:
        """Explore groups best-first, then trace the best candidate exactly until the best is one
        already traced: a verification that fits can reveal room for a larger micro-batch (the line
        through it is more accurate up there), one that does not fit shrinks the choice."""
        if self.settled is not None:
            return self.settled, self.traces[self.settled.trace_key]
        verified: list[Candidate] = []
        verifications = 0
        while True:
            best = self.best_fit()
            group = self.next_group(best)
            if group is not None:
                if best is not None:  # its verification, beside the exploration (wasted if the group wins)
                    self.prefetch(*best.trace_key)
                self.explore(group)
                continue
            if not self.floors.claim_checked:  # no trace has checked the optimizer claim (floors.py):
                self.floors.withdraw_claim()   # it decides nothing unconfirmed; search on without it
                continue
            if best is None:
                raise self.no_fit()
            if best.trace_key in self.traces:
                return self.finish(best)
            if verifications >= MAX_VERIFICATIONS and verified:
                return self.finish(fastest(verified))
            est = self.trace(*best.trace_key)
            verifications += 1
            # The measurement joins the curve (which removes this trace's own NCCL bytes, whatever
            # its world size): every later prediction of the group uses it.
            self.curves[best.group].add(best.micro_batch_size, est)
            if est.device_total <= best.budget_bytes and best.host_fits:
                verified.append(best)

    def finish(self, best: Candidate) -> tuple[Candidate, MemoryEstimate]:
        """The verified best, or partial checkpointing where it is faster and a trace confirms it fits
        (partial.py); a partial winner joins the search's candidates for the plan's account."""
        partial = partial_checkpointing(self, best)
        if partial is None:
            return best, self.traces[best.trace_key]
        group = partial.group
        self.groups[group] = [partial]
        self.curves[group] = MemoryCurve()
        self.curves[group].add(partial.micro_batch_size, self.traces[partial.trace_key])
        self.explored.add(group)
        self.candidates.append(partial)
        return partial, self.traces[partial.trace_key]

    def no_fit(self) -> NoFit:
        """The error for an empty search (memplan.planner.nofit)."""
        return no_fit_error(self)


def make_plan(request: PlanRequest, estimator: Estimator) -> Plan:
    """The fastest setting (costs.predict_step) whose traced memory fits every chosen GPU and the
    host, with the runners-up and the reasons. Raises NoFit when nothing fits, ValueError for a bad
    request (checked when the PlanRequest is built)."""
    if not isinstance(request, PlanRequest):
        raise ValueError(f"make_plan: request must be a PlanRequest; got {type(request).__name__}")
    known: dict[tuple, MemoryEstimate] = {}
    cancel_all = getattr(estimator, "cancel", None) or (lambda: None)  # a background estimator's prefetches
    while True:  # twice at most: a second search has user_checkpointing set and does not raise
        try:
            search = _Search(request, estimator, known)
            winner, est = search.run()
            break
        except _OwnCheckpointing as found:
            request = dataclasses.replace(
                request, allow_checkpointing=False, user_checkpointing=(
                    f"torch.utils.checkpoint called {found.calls} times a step inside the model's forward"))
            known = found.traces
        finally:
            cancel_all()
    return describe_plan(request, winner, est, search)
