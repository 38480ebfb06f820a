"""benchmarks.gpu_fidelity: this tree's emulated H200 estimates against the truths the first GPU campaign
measured on an H200 (torch 2.11.0+cu130, benchmarks/results/gpu_campaign_raw/), re-estimated on CPU; and the
same for the second campaign's H100 (benchmarks/results/gpu_campaign_raw_h100/)."""
import json

import pytest

from benchmarks.gpu_fidelity import RAW, main, recorded, render, run


def test_biased_mlps_match_the_h200_allocated_reserved_and_nvml_figures():
    """The first campaign's estimates (part1.json) ran 1 MiB under (cuBLASLt's workspace), 24-26 MiB over NVML (the
    context); session 9's call (part1c.json) re-measured both cases, and this tree matches its truths."""
    first = {r["case"]: r for r in json.loads((RAW / "part1.json").read_text())["sections"]["accuracy_zoo"]["rows"]}
    report = run(["linear-b64-sgd", "mlp-b64"])
    for row in report["rows"]:
        assert first[row["case"]]["emulated_err_allocated"] < -0.01  # the first campaign: 1 MiB under the truth
        assert row["run"]["file"] == "part1c.json" and first[row["case"]]["truth"] == row["truth"]
        assert abs(row["now_err_allocated"]) < 0.0005
        assert row["now_err_reserved"] == 0.0
        assert abs(row["now_err_nvml"]) < 0.005


def test_a_gpt2_reserved_peak_follows_workspaces_taken_at_first_use():
    """GPT-2 small, batch 4: the first campaign's estimate reserved 34 MiB (one cuBLAS workspace's segment) too much;
    session 9 read the same truth."""
    (first,) = [r for r in json.loads((RAW / "part1.json").read_text())["sections"]["accuracy_zoo"]["rows"]
                if r["case"] == "gpt2-b4"]
    (row,) = run(["gpt2-b4"])["rows"]
    assert first["emulated_err_reserved"] > 0.04 and first["truth"] == row["truth"]
    assert abs(row["now_err_reserved"]) < 0.005


H100_RAW = RAW.parent / "gpu_campaign_raw_h100"


def test_the_h100_campaign_is_read_with_its_follow_up_call_and_estimated_for_the_h100():
    """The H100's part 1 came in two calls (part1b.json: the 16 extra variants the first left): every case of both
    is re-estimated, for the catalog's H100, and the report names that card and its folder."""
    cases = recorded(H100_RAW)
    assert len(cases) == 44 and "bert-b8-bf16mixed-gpu" in cases and "mixer-b16-bf16mixed-ckpt" in cases
    report = run(["mlp-b64-16mixed-gpu"], raw=H100_RAW)
    assert report["campaign"]["gpu"] == "H100-80GB" and report["campaign"]["raw"].endswith("gpu_campaign_raw_h100/")
    (row,) = report["rows"]
    assert abs(row["now_err_allocated"]) < 0.0005 and row["now_err_reserved"] == 0.0
    assert "emulated H100-80GB estimates" in render(report)


def test_another_campaign_without_a_card_would_overwrite_the_first_and_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--raw", str(H100_RAW)])
    assert "--card" in capsys.readouterr().err


EXPANDABLE_RAW = RAW.parent / "gpu_campaign_raw_expandable"


def test_the_expandable_segments_campaign_is_re_estimated_under_its_setting(monkeypatch):
    """mlp-b1024 reserved 86 MiB on the H200 with expandable segments (90 MiB at the defaults, part1.json): the
    re-estimate runs under the campaign's PYTORCH_CUDA_ALLOC_CONF, whatever this process has set."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    report = run(["mlp-b1024"], raw=EXPANDABLE_RAW)
    (row,) = report["rows"]
    assert row["truth"]["max_reserved"] == 86 << 20 and row["now"]["peak_reserved"] == 86 << 20
    assert report["campaign"]["allocator"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert "under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in render(report).splitlines()[0]
    default = recorded()["mlp-b1024"]
    assert default["truth"]["max_reserved"] == 90 << 20 and default["run"]["file"] == "part1.json"
