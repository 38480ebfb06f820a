"""Every benchmark figure README.md quotes is the committed results JSON's, so none can go stale.

Each claim is a pattern in README.md whose groups are figures, and the figures the committed
benchmarks/results/*.json give for them (readme_figures.py computes them). A claim that no longer matches fails
(the sentence changed: update the claim), and so does a figure that differs from the JSON (a benchmark was
re-run: update the README). So that a new figure cannot slip in unchecked, every percentage in the README's
accuracy paragraphs (from "## Accuracy" to "### What the trace cannot see", and the FSDP accuracy paragraph)
must lie inside a claim, unless it is a goal ("<= 1 %"). published_gpu.json's own consistency is
test_published_gpu_results.py's.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import readme_figures as figures
from readme_figures import NUM, README, results


@dataclass(frozen=True)
class Claim:
    name: str
    pattern: str
    expected: Callable[[], tuple[str, ...]]


CLAIMS = [
    Claim("accuracy_cpu table",
          r"\| memplan \(vs the whole run\) \| NUM % \| NUM % \(`([\w.-]+)`, NUM B (under|over)[^|]*\|\n"
          r"\| memplan \(vs the steady-state step\) \| NUM % \| NUM % \(`([\w.-]+)`, NUM B (under|over)\) \|\n"
          r"\| 4 B x \(3 x params \+ 2 x activations x batch\) \| NUM % \| NUM % \|\n"
          r"\| 4 x model size \| NUM % \| NUM % \|", figures.cpu_table),
    Claim("accuracy_cpu counts",
          r"Measured on a 2-core ([\w ]+) \((\d{4}-\d\d-\d\d)[^)]*\)\. (\d+) of (\d+)\s+cases match the truth to the "
          r"byte and (\d+) within 0\.01 %", figures.cpu_counts),
    Claim("realmodels",
          r"`benchmarks/results/realmodels\.md`\): (\d+) cases from transformers\s+config classes and plain torch "
          r"\([^)]*; (\d+) trained by a plain PyTorch loop\)\. Last run \((\d{4}-\d\d-\d\d), 2-core ([\w ]+),\s+"
          r"(\d+) compared with a truth\): median \|error\| NUM %, worst NUM %\s+\(`([\w.-]+)`", figures.realmodels),
    Claim("heldout_sweep",
          r"against the same\s+Trainer-based truth: (\d+) cases, (\d+) within 0\.1 %, median \|error\| NUM %, worst NUM %"
          r" \(`([\w.-]+)`", figures.heldout),
    Claim("heldout_sweep6",
          r"(?s)A sixth sweep \(`\.venv/bin/python -m benchmarks\.heldout_sweep6_run`.*?\): (\d+) cases, (\d+) within\s+"
          r"0\.1 %, median \|error\| NUM %, worst NUM %\s+\(`([\w.-]+)`[^)]*\); estimate refused: ([\w., -]+)\.",
          figures.heldout6),
    Claim("accuracy_fsdp_cpu",
          r"`benchmarks/results/accuracy_fsdp_cpu\.md`, (\d+) cases:[^;]*;\s+(\d+) rank\s+figures, each rank's profiled "
          r"peak over build \+ 2 steps\) the median error is NUM % and the worst\s+NUM %: the goal \(median <= 1 %, "
          r"worst <= 3 %\) is met\. (\d+) of the (\d+) rank figures match to 0\.001 %;\s+the other (\d+) \([^)]*\) peak "
          r"[\d.]+ KB below the estimate \(NUM-NUM %", figures.fsdp),
    Claim("published_gpu",  # any space may be a line break
          (r"(?s)Against GPU memory others published \(`\.venv/bin/python -m benchmarks\.published_gpu`.*?: (\d+) "
          r"figures\. The (\d+) measured with torch >= 2\.1 .*? estimate at median \|error\| NUM % and worst NUM % "
          r"\(`([\w.-]+)`\) with the published torch's kernels reproduced.*?with this torch's kernels: median NUM %, "
          r"worst NUM % \(`([\w.-]+)`\)\. The goal \(median <= 1 %, worst <= 3 %\) is (met|not met)\..*?The (\d+) "
          r"bert-large figures .*? reproduce at median NUM %, worst NUM %\.").replace(" ", r"\s+"),
          figures.published_gpu),
    Claim("accuracy_gpu",  # any space may be a line break
          (r"(?s)On one ([\w.-]+(?: [\w.-]+)*) \(driver ([\d.]+), torch ([\w.+]+), "
           r"`benchmarks/results/accuracy_gpu\.md`\): (\d+) of the zoo's (\d+) cases, each at its newest reading: "
           r"(\d+) measured in session 9 \((\d+) calls, memplan ([0-9a-f]+)\), (\d+) only in the first campaign "
           r"\(memplan ([0-9a-f]+), [^)]*\); (\d+) with a native estimate\. Native: `peak_allocated` median "
           r"\|error\| NUM %, worst NUM % \(`([\w.-]+)`\); `peak_reserved` median NUM %, worst NUM % "
           r"\(`([\w.-]+)`\); `device_total` median NUM %, worst NUM % \(`([\w.-]+)`\)\. The goal \(median <= 3 %, "
           r"worst <= 6 %, never under by more than 2 %\) is (met|not met)\. On session 9's (\d+) cases alone: "
           r"`peak_allocated` worst NUM % \(`([\w.-]+)`\), `peak_reserved` worst NUM % \(`([\w.-]+)`\), "
           r"`device_total` worst NUM % \(`([\w.-]+)`\); .*?The memory outside the allocator "
           r"\(NVML's process peak - `max_memory_reserved`\) measured (\d+)-(\d+) MiB against memplan's (\d+) MiB "
           r"constant").replace(" ", r"\s+").replace(r"[\w.-]+(?:\s+[\w.-]+)*", r"[\w.-]+(?: [\w.-]+)*"),
          figures.accuracy_gpu),
    Claim("gpu_fidelity",
          (r"(?s)re-estimated on CPU with CUDA emulated \(`benchmarks/results/gpu_fidelity\.md`, n=(\d+)\): "
           r"`peak_allocated` median \|error\| NUM %, worst NUM %; `peak_reserved` median NUM %, worst NUM %; "
           r"`device_total` median NUM %, worst NUM %").replace(" ", r"\s+"), figures.gpu_fidelity),
    Claim("h200_truths_reread", r"the\s+(\d+)\s+cases\s+both\s+H200\s+runs\s+measured\s+read\s+the\s+same\s+truths\s+to\s+"
          r"the\s+byte", figures.h200_truths_reread),
    Claim("accuracy_gpu_expandable",
          (r"(?s)One GPU run has measured expandable segments since \(one H200, torch 2\.11, session 9: (\d+) zoo "
           r"cases on one GPU, none of them FSDP; `benchmarks/results/accuracy_gpu_expandable\.md`\): memplan's "
           r"emulated `peak_reserved` is exact for (\d+) of the (\d+), NUM % for `([\w.-]+)`, and under for the two "
           r"cuDNN RNN cases, `([\w.-]+)` NUM % and `([\w.-]+)` NUM % \(NUM % and NUM % at the default settings\)")
          .replace(" ", r"\s+"), figures.accuracy_gpu_expandable),
    Claim("gpu_fidelity_expandable",
          (r"(?s)re-estimates them \(`benchmarks/results/gpu_fidelity_expandable\.md`, n=(\d+)\): `peak_reserved` "
           r"median \|error\| NUM %, worst NUM %; `([\w.-]+)` NUM %, `([\w.-]+)` NUM %").replace(" ", r"\s+"),
          figures.gpu_fidelity_expandable),
    Claim("conv_workspace",
          (r"(?s)leave-one-shape-out median error NUM % of the workspace, .*?the conv cases' `peak_reserved` median "
           r"\|error\| NUM % -> NUM % on the H200 \(cnn-b64-bf16mixed NUM % -> NUM %\), NUM % -> NUM % on the H100 "
           r"\(resnet18-b8-ckpt-gpu NUM % -> NUM %\)").replace(" ", r"\s+"), figures.conv_workspace),
    Claim("memory_gaps_gpu",
          r"\(`benchmarks/results/memory_gaps_gpu\.md`, (\d+) cases\): native `peak_allocated` within NUM %,\s+"
          r"`peak_reserved` within NUM %", figures.memory_gaps_vit),
    Claim("step_time_gpu",
          (r"(?s)Against step times measured on one ([\w-]+ [\w-]+) \(.*?: (\d+) settings, .*?\) the predicted step is "
           r"off by NUM % median and NUM % at worst \((GPT-2 small|ViT-L/16), ([\w-]+), micro-batch (\d+), ((?:no )?checkpointing)\): "
           r"32-true within NUM % to NUM %, bf16-mixed from NUM % to NUM %").replace(" ", r"\s+")
          .replace(r"[\w-]+\s+[\w-]+", r"[\w-]+ [\w-]+"), figures.step_time_gpu),
    Claim("step_time_cards",
          (r"(?s)median \|error\| went from NUM % to NUM % \((H200); worst NUM % to NUM %\) and from NUM % to NUM % "
           r"\((H100); worst NUM % to NUM %\)").replace(" ", r"\s+"), figures.step_time_cards),
    Claim("nccl_one_rank_gpu", r"a 1-rank NCCL group and its all-reduce took (\d+) MiB outside the allocator",
          figures.nccl_one_rank),
    Claim("plan_vs_bisect_gpu", r"\(cut short: memplan's (\d+) ran, and (\d+), on an H200", figures.plan_vs_bisect_gpu),
    Claim("accuracy_gpu_h100",  # any space may be a line break, but in the GPU's name
          (r"(?s)Second run, on one ([\w.-]+(?: [\w.-]+)*) \(driver ([\d.]+), torch ([\w.+]+), "
           r"`benchmarks/results/accuracy_gpu_h100\.md`\): the (\d+) zoo cases the first run cut off and the (\d+) extra "
           r"variants \([^)]*\), (\d+) cases, (\d+) with a native estimate\. Native: `peak_allocated` median \|error\| "
           r"NUM %, worst NUM % \(`([\w.-]+)`\); `peak_reserved` median NUM %, worst NUM % \(`([\w.-]+)`\); "
           r"`device_total` median NUM %, worst NUM % \(`([\w.-]+)`\)\. The goal is (met|not met)\. Outside the "
           r"allocator: (\d+)-(\d+) MiB against memplan's (\d+) MiB constant").replace(" ", r"\s+")
          .replace(r"[\w.-]+(?:\s+[\w.-]+)*", r"[\w.-]+(?: [\w.-]+)*"), figures.accuracy_gpu_h100),
    Claim("gpu_fidelity_h100",
          (r"(?s)estimates of the same cases for the catalog's H100 \(`benchmarks/results/gpu_fidelity_h100\.md`, "
           r"n=(\d+)\): `peak_allocated` median \|error\| NUM %, worst NUM %; `peak_reserved` median NUM %, worst "
           r"NUM %; `device_total` median NUM %, worst NUM %").replace(" ", r"\s+"), figures.gpu_fidelity_h100),
    Claim("accuracy_gpu_h200_s13",  # any space may be a line break, but in the GPU's name
          (r"(?s)Third run, on one ([\w.-]+(?: [\w.-]+)*) again \(driver ([\d.]+), torch ([\w.+]+), "
           r"`benchmarks/results/accuracy_gpu_h200-s13\.md`\): all (\d+) zoo cases and the (\d+) extra variants, (\d+) "
           r"cases, every estimate by memplan ([0-9a-f]{7})\. Emulated: `peak_allocated` median \|error\| NUM %, worst "
           r"NUM % \(`([\w.-]+)`\); `peak_reserved` median NUM %, worst NUM % \(`([\w.-]+)`\); `device_total` median "
           r"NUM %, worst NUM % \(`([\w.-]+)`\)").replace(" ", r"\s+")
          .replace(r"[\w.-]+(?:\s+[\w.-]+)*", r"[\w.-]+(?: [\w.-]+)*"), figures.accuracy_gpu_h200_s13),
    Claim("gpu_fidelity_h200_s13",
          (r"(?s)this tree's emulated estimates of the same cases \(`benchmarks/results/gpu_fidelity_h200-s13\.md`, "
           r"n=(\d+)[^)]*\): `peak_allocated` median \|error\| NUM %, worst NUM %; `peak_reserved` median NUM %, "
           r"worst NUM %; `device_total` median NUM %, worst NUM %").replace(" ", r"\s+"), figures.gpu_fidelity_h200_s13),
    Claim("step_time_gpu_h100",
          (r"(?s)On one ([\w.-]+(?: [\w.-]+)*), the same (\d+) settings "
           r"\(\[benchmarks/results/step_time_gpu_h100\.md\]\(benchmarks/results/step_time_gpu_h100\.md\)\): off by "
           r"NUM % median and NUM % at worst \((GPT-2 small|ViT-L/16), ([\w-]+), micro-batch (\d+), ((?:no )?checkpointing)\); "
           r"32-true within NUM % to NUM %, bf16-mixed from NUM % to NUM %\. There GPT-2 small's bf16-mixed step at "
           r"micro-batch (\d+) keeps the GPU busy for (\d+) % of its unprofiled time .*? its kernels alone take "
           r"(longer|no longer) than memplan's whole predicted step").replace(" ", r"\s+")
          .replace(r"[\w.-]+(?:\s+[\w.-]+)*", r"[\w.-]+(?: [\w.-]+)*"), figures.step_time_gpu_h100),
    Claim("callback_overhead_gpu_h100",
          (r"(?s)On one ([\w.-]+(?: [\w.-]+)*) \(GPT-2 small, ([\w-]+), micro-batch (\d+): "
           r"`benchmarks/results/callback_gpu_h100\.md`\) NUM % end to end \(NUM -> NUM ms a step\) and NUM ms a "
           r"step of its own code, (over|under) the NUM % goal: its readings \((\d+) in the (\d+) steps timed\)")
          .replace(" ", r"\s+").replace(r"[\w.-]+(?:\s+[\w.-]+)*", r"[\w.-]+(?: [\w.-]+)*"),
          figures.callback_overhead_gpu_h100),
    Claim("oom_retry_and_cnn_bisect_gpu_h100",
          (r"(?s)recovered from a real CUDA OOM on an H100 \(`benchmarks/results/callback_gpu_h100\.md`\): a loaded "
           r"batch of (\d+) GPT-2-small samples planned as one micro-batch ran out of memory in its (\w+), was "
           r"retried on the same samples at micro-batch (\d+), and the (\d+)-step fit (finished|did not finish).*?on "
           r"`cnn` \(([\w-]+), H100: `benchmarks/results/plan_vs_bisect_gpu_h100\.md`\) memplan's largest and the "
           r"largest that ran both reached the search's cap of (\d+), and `memplan suggest` took NUM s against "
           r"BatchSizeFinder's NUM s \(which settled on (\d+)\), so the goal of a tenth of its time is (met|not met)")
          .replace(" ", r"\s+"), figures.oom_and_cnn_gpu_h100),
    Claim("torchtitan_memory",
          r"estimates NUM GiB `max_memory_reserved` against the published NUM GiB \(NUM %, within\s+the goal of "
          r"NUM %\), of which NUM GiB is cached by FSDP2's[^:]*:[^;]*one pool for all streams\s+gives NUM GiB",
          figures.torchtitan),
    Claim("logs_at_scale",
          r"\(10\^(\d+) lines over (\d+) ranks, (\d+) MB: NUM s and\s+NUM MiB on a quiet 2-core ([\w ]+),",
          figures.logs_at_scale),
    Claim("test_suite_stress",
          r"Its last record under load \(`benchmarks/results/test_suite_stress\.json`\): (\d+) runs in a row, ([a-z ]+),"
          r"\s+with (\d+) burners,\s+in ([\d. and]+) min\s+\(commit (\w+)", figures.suite_stress),
    Claim("test_suite_time",
          r"The suite \((\d+) tests\)\s+passed in NUM min on a 2-core ([\w ]+) at load average ([\d-]+) \([^)]*\); "
          r"it used NUM\s+CPU-minutes in all \(`benchmarks/results/test_suite_time\.json`\), so a quiet 2-core "
          r"machine needs about NUM min", figures.suite_time),
]


def _readme() -> str:
    return README.read_text()


def _match(claim: Claim) -> re.Match:
    found = list(re.finditer(claim.pattern.replace("NUM", NUM), _readme()))
    assert len(found) == 1, f"README.md: the {claim.name} sentence is {'gone or reworded' if not found else 'repeated'}"
    return found[0]


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.name)
def test_readme_quotes_the_committed_results(claim):
    assert _match(claim).groups() == claim.expected()


def _checked_sections(text: str) -> list[tuple[int, int]]:
    """The accuracy paragraphs: "## Accuracy" up to "### What the trace cannot see", and the FSDP one."""
    start = text.index("## Accuracy")
    spans = [(start, text.index("### What the trace cannot see", start))]
    fsdp = text.index("against real 2- and 4-rank runs on CPU")
    spans.append((fsdp, text.index("\n\n", fsdp)))
    return spans


def test_every_percentage_in_the_accuracy_paragraphs_is_checked():
    text = _readme()
    claimed = [_match(c).span() for c in CLAIMS]
    unchecked = []
    for lo, hi in _checked_sections(text):
        for m in re.finditer(r"[-+]?\d[\d.,]* ?%", text[lo:hi]):
            at = lo + m.start()
            if any(a <= at < b for a, b in claimed) or re.search(r"<= ?$", text[max(0, at - 4):at]):
                continue
            unchecked.append(text[max(0, at - 60):at + len(m.group())].replace("\n", " "))
    assert unchecked == [], "figures in README.md's accuracy paragraphs that no claim checks"


def test_a_stale_figure_fails():
    claim = CLAIMS[0]
    m = _match(claim)
    stale = _readme()[: m.start(1)] + "9.999" + _readme()[m.end(1):]
    again = re.search(claim.pattern.replace("NUM", NUM), stale)
    assert again is not None and again.groups() != claim.expected()


def test_the_summaries_are_the_rows():
    """The JSON's own summary agrees with its rows, so a claim built on either reads the same run."""
    s = results("realmodels")["summary"]
    errors = [abs(r["error"]) for r in results("realmodels")["rows"] if "error" in r]
    assert s["all"]["measured"] == len(errors)
    assert s["all"]["median_abs_error"] == statistics.median(errors)
    assert s["all"]["worst_abs_error"] == max(errors)
