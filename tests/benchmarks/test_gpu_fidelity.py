"""benchmarks.gpu_fidelity: this tree's emulated H200 estimates against the truths the first GPU campaign
measured on an H200 (torch 2.11.0+cu130, benchmarks/results/gpu_campaign_raw/), re-estimated on CPU; and the
same for the second campaign's H100 (benchmarks/results/gpu_campaign_raw_h100/)."""
import pytest

from benchmarks.gpu_fidelity import RAW, main, recorded, render, run


def test_biased_mlps_match_the_h200_allocated_reserved_and_nvml_figures():
    """The recorded estimates ran 1 MiB under (cuBLASLt's workspace), 24-26 MiB over NVML (the context)."""
    report = run(["linear-b64-sgd", "mlp-b64"])
    for row in report["rows"]:
        assert row["recorded_err_allocated"] < -0.01  # what the campaign recorded: 1 MiB under the truth
        assert abs(row["now_err_allocated"]) < 0.0005
        assert row["now_err_reserved"] == 0.0
        assert abs(row["now_err_nvml"]) < 0.005


def test_a_gpt2_reserved_peak_follows_workspaces_taken_at_first_use():
    """GPT-2 small, batch 4: the recorded estimate reserved 34 MiB (one cuBLAS workspace's segment) too much."""
    (row,) = run(["gpt2-b4"])["rows"]
    assert row["recorded_err_reserved"] > 0.04
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
