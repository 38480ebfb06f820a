"""Held-out sweep: memplan on architectures that no realmodels case covers, against a real CPU truth.

    python -m benchmarks.heldout_sweep                  # every case; writes results/heldout_sweep.{md,json}
    python -m benchmarks.heldout_sweep --only NAME ...  # some cases (add --write to replace their rows)

Built as benchmarks/realmodels.py builds its cases (transformers config classes at small sizes, no hub
access, or plain torch from benchmarks/heldout_models.py); the truth is benchmarks/cpu_truth.measure (a
real Lightning `Trainer.fit`, profiler "Total Allocated" peak over build + 2 steps, fresh process), the
estimate `memplan.estimate(build, batch, device="cpu")` in another fresh process. A case that fails to
build, or whose truth cannot run on CPU, is listed with its error and not counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
from typing import Any

from benchmarks import heldout_cases4, heldout_cases5
from benchmarks import heldout_models as hm
from benchmarks import heldout_models4 as hm4
from benchmarks.accuracy_cpu import _run_json
from benchmarks.heldout_inputs import (
    _IMG,
    _LLAVA,
    _S2S,
    _SPEECH,
    _image_tuple,
    ids_labels,
    llava_batch,
    patchtst_batch,
    pixels_only,
    speech_features_batch,
    time_series_batch,
    wave_batch,
)
from benchmarks.realmodels import compare
from benchmarks.realmodels import estimate_one as _estimate_one
from benchmarks.realmodels_cases import _DEC, _ENC, _VIT, _hf_case
from benchmarks.realmodels_models import (
    SEQ,
    VOCAB,
    cls_batch,
    image_batch,
    plain_batch,
    plain_loss,
    seq2seq_batch,
    speech_ctc_batch,
    token_batch,
)
from benchmarks.results_io import RESULTS, machine, write_results
from benchmarks.zoo import OPTIMIZERS, Case

WITHIN = 0.001
SWEEP_OPTIMIZERS = {**hm4.OPTIMIZERS, **heldout_cases5.OPTIMIZERS}
"""Optimizers the sweeps' cases name besides benchmarks.zoo.OPTIMIZERS (registered there in the truth's process)."""
MiB = 1 << 20
CAUSES = [(
    "- orthogonal-rnn (parametrizations.orthogonal: matrix_exp of a skew matrix every forward): -9.894 %. "
    "Class: CPU linear algebra's own buffers, which no fake tensor shows: matrix_exp's Pade terms (4 to 12 x n^2 "
    "floats by the input's 1-norm) peak inside its backward, which exponentiates a 2n x 2n block matrix; LAPACK "
    "ops (qr, svd, eigh, solve) keep work arrays of their shape alone (zeros and random inputs take the same). "
    "Fixed: kernels/probe.py probes these ops, matrix_exp at its worst-case norm (named in the notes): "
    "+5.069 % after (an upper bound: this model's norms take 9 of the 12 n^2 in the real backward); "
    "tests/estimator/test_linalg_scratch.py. Before the fix (commit 1e21b2b, the 50 cases then): 50 compared, "
    "49 within 0.1 %, worst -9.894 %. The rows are several runs merged (--merge): all but orthogonal-rnn were "
    "estimated before the probe change, which none of them reaches (no linear algebra op)."
), (
    "- llava-image-tokens (added later, on the tree of its commit): LLaVA's image features scattered into the "
    "token embeddings (`masked_scatter` under a mask computed from the batch's ids). Exact; its peak is the loss. "
    "The class it stands for: masked_scatter's CPU backward, whose scratch follows the mask's count of True, was "
    "probed under a zero mask (17 to 28 % under on a model whose peak it is); kernels/probe.py now probes it under "
    "the batch's own mask (tests/estimator/test_probed_kernel_scratch.py)."
), (
    "- The fourth sweep (49 cases of benchmarks/heldout_cases4.py, session 14; truths and estimates on the tree of "
    "its start, the rows named below re-estimated after the fixes) found four classes. A bf16 LayerNorm with float32 "
    "weights (CPU autocast) keeps float32 statistics where the meta kernel says bf16: swinv2-cosine-attn-bf16mixed "
    "-0.325 % before (kernels/rules.py; it also closed the zoo's two worst CPU cases). Learned fake quantization's "
    "CPU backward holds per-element scale and zero-point gradients: qat-learnable-fake-quant -5.908 % before "
    "(kernels/probe.py). nn.init.trunc_normal_'s rejection loop never ended on a large fake weight (any() read as "
    "True while building): modernbert-unpadded's estimate ran past 600 s (estimator/fake.py). torch.func transforms "
    "refuse saved-tensor hooks, under which memplan traces: jacobian-vmap-jacrev fails, now by name with a variant "
    "that traces (estimator/diagnose.py). boolean-mask-token-pruning (-2.899 %) is the documented assumption: a mask "
    "computed from an activation is answered by random values of its shape (named in the notes); the real gate kept "
    "154 of 256 tokens at the start."
), (
    "- The fifth sweep (66 cases of benchmarks/heldout_cases5.py, session 15; truths and estimates on the tree of its "
    "start, the misses re-estimated after their fixes): 64 compared, 63 within 0.1 % before the fixes. "
    "pixel-unshuffle-lrn-mish was -0.204 %: on a channels_last input the CPU backward of adaptive_max_pool2d copies "
    "the NCHW gradient to channels_last; pooling, padding and group norm now probed (kernels/probe.py _LAYOUT_OPS), "
    "and a channels_last CNN flattened after max_pool2d (-21.9 %) is exact. Two estimates stop by name where the real "
    "run trains: nn.EmbeddingBag(sparse=True) (memplan's documented refusal) and torch.sparse.mm of a sparse COO "
    "tensor built in forward, whose fake conversion torch lacks (it failed on explaining that error before)."
), (
    "- Every other row is within 0.1 % (worst |error| 0.004 %, time-series-transformer's StudentT likelihood)."
)]
"""The misses found, their class and what was done (rendered under the table)."""


def _cases() -> list[tuple]:
    """(name, family, build, make_batch, loss, settings)."""
    h = _hf_case
    cases = [
        # vision
        ("vit-mae-random-masking", "vision", *h("ViTMAEForPreTraining", "ViTMAEConfig", batch=pixels_only,
                                                **{**_VIT, "decoder_hidden_size": 64, "decoder_num_hidden_layers": 1,
                                                   "decoder_num_attention_heads": 4,
                                                   "decoder_intermediate_size": 128}), {}),
        ("beit-rel-pos", "vision", *h("BeitForImageClassification", "BeitConfig", None, batch=image_batch, **_VIT,
                                      use_relative_position_bias=True), {}),
        ("segformer", "vision", *h("SegformerForImageClassification", "SegformerConfig", None, batch=image_batch,
                                   num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64],
                                   patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                   **_IMG), {}),
        ("mobilenet-v2", "cnn", *h("MobileNetV2ForImageClassification", "MobileNetV2Config", None, batch=image_batch,
                                   image_size=32, depth_multiplier=0.35, **_IMG), {}),
        ("efficientnet", "cnn", *h("EfficientNetForImageClassification", "EfficientNetConfig", None, batch=image_batch,
                                   image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                                   drop_connect_rate=0.0, **_IMG), {}),
        ("regnet", "cnn", *h("RegNetForImageClassification", "RegNetConfig", None, batch=image_batch, embedding_size=16,
                             hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, **_IMG), {}),
        ("levit", "vision", *h("LevitForImageClassification", "LevitConfig", None, batch=image_batch, image_size=32,
                               hidden_sizes=[32, 64], num_attention_heads=[2, 2], depths=[1, 1], key_dim=[8, 8],
                               mlp_ratio=[2, 2], attention_ratio=[2, 2],
                               down_ops=[["Subsample", 8, 4, 4, 2, 2]], **_IMG), {}),
        ("mobilevit", "vision", *h("MobileViTForImageClassification", "MobileViTConfig", None, batch=image_batch,
                                   image_size=32, hidden_sizes=[32, 48, 64],
                                   neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 96],
                                   num_attention_heads=2, **_IMG), {}),
        ("poolformer", "vision", *h("PoolFormerForImageClassification", "PoolFormerConfig", None, batch=image_batch,
                                    num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                                    strides=[4, 2], padding=[2, 1], **_IMG), {}),
        ("focalnet", "vision", *h("FocalNetForImageClassification", "FocalNetConfig", None, batch=image_batch,
                                  image_size=32, patch_size=2, embed_dim=32, depths=[1, 1], focal_levels=[2, 2],
                                  focal_windows=[3, 3], **_IMG), {}),
        # encoders
        ("longformer", "encoder", *h("LongformerForSequenceClassification", "LongformerConfig", None, batch=cls_batch,
                                     **{**_ENC, "max_position_embeddings": 258}, attention_window=16,
                                     pad_token_id=0), {}),
        ("big-bird-block-sparse", "encoder", *h(
            "BigBirdForSequenceClassification", "BigBirdConfig", None,
            batch=functools.partial(cls_batch, seq_len=256), **{**_ENC, "max_position_embeddings": 512},
            attention_type="block_sparse", block_size=16, num_random_blocks=2), {}),
        ("funnel", "encoder", *h("FunnelForSequenceClassification", "FunnelConfig", None, batch=cls_batch,
                                 vocab_size=VOCAB, block_sizes=[1, 1], num_decoder_layers=1, d_model=128, n_head=4,
                                 d_head=32, d_inner=256, num_labels=4), {}),
        ("xlnet", "encoder", *h("XLNetForSequenceClassification", "XLNetConfig", None, batch=cls_batch,
                                vocab_size=VOCAB, d_model=128, n_layer=2, n_head=4, d_inner=256, num_labels=4), {}),
        ("fnet-fft", "encoder", *h("FNetForSequenceClassification", "FNetConfig", None, batch=ids_labels,
                                   **{k: v for k, v in _ENC.items() if k != "num_attention_heads"}), {}),
        ("perceiver", "encoder", *h("PerceiverForSequenceClassification", "PerceiverConfig", None,
                                    batch=functools.partial(cls_batch, vocab=262), d_model=64, num_latents=32,
                                    d_latents=64, num_blocks=1, num_self_attends_per_block=2,
                                    num_self_attention_heads=4, num_cross_attention_heads=4, num_labels=4), {}),
        ("convbert", "encoder", *h("ConvBertForSequenceClassification", "ConvBertConfig", None, batch=cls_batch,
                                   **_ENC, embedding_size=128), {}),
        ("squeezebert", "encoder", *h("SqueezeBertForSequenceClassification", "SqueezeBertConfig", None,
                                      batch=cls_batch, **_ENC, embedding_size=128), {}),
        ("nystromformer", "encoder", *h("NystromformerForSequenceClassification", "NystromformerConfig", None,
                                        batch=ids_labels, **_ENC, num_landmarks=16, segment_means_seq_len=SEQ,
                                        conv_kernel_size=9), {}),
        ("esm-rotary", "encoder", *h("EsmForSequenceClassification", "EsmConfig", None,
                                     batch=functools.partial(cls_batch, vocab=33), **{**_ENC, "vocab_size": 33},
                                     pad_token_id=1, mask_token_id=32, position_embedding_type="rotary"), {}),
        # decoders
        ("biogpt", "decoder", *h("BioGptForCausalLM", "BioGptConfig", **_DEC), {}),
        ("xglm", "decoder", *h("XGLMForCausalLM", "XGLMConfig", None, vocab_size=VOCAB, d_model=128, num_layers=2,
                               attention_heads=4, ffn_dim=256, max_position_embeddings=256, use_cache=False), {}),
        ("rwkv", "recurrent", *h("RwkvForCausalLM", "RwkvConfig", None, vocab_size=VOCAB, hidden_size=128,
                                 num_hidden_layers=2, attention_hidden_size=128, intermediate_size=256,
                                 context_length=SEQ, use_cache=False), {}),
        ("recurrent-gemma", "recurrent", *h("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", None,
                                            vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                            head_dim=32, lru_width=128, attention_window_size=16,
                                            block_types=["recurrent", "attention"], use_cache=False), {}),
        ("jamba", "hybrid", *h("JambaForCausalLM", "JambaConfig", None, **_DEC, num_key_value_heads=2, num_experts=2,
                               expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                               mamba_d_state=8, use_mamba_kernels=False), {}),
        ("deepseek-v3-mla-moe", "moe", *h("DeepseekV3ForCausalLM", "DeepseekV3Config", **_DEC, num_key_value_heads=4,
                                          moe_intermediate_size=64, first_k_dense_replace=1, n_routed_experts=4,
                                          num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
                                          kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                          v_head_dim=32), {}),
        ("gpt-oss-sinks-moe", "moe", *h("GptOssForCausalLM", "GptOssConfig", "eager",
                                        **{**_DEC, "intermediate_size": 128}, num_key_value_heads=2, head_dim=32,
                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=16), {}),
        # encoder-decoders
        ("m2m100", "encoder-decoder", *h("M2M100ForConditionalGeneration", "M2M100Config", batch=seq2seq_batch,
                                         **_S2S, max_position_embeddings=256, encoder_layerdrop=0.0,
                                         decoder_layerdrop=0.0), {}),
        ("led", "encoder-decoder", *h("LEDForConditionalGeneration", "LEDConfig", None, batch=seq2seq_batch, **_S2S,
                                      max_encoder_position_embeddings=256, max_decoder_position_embeddings=64,
                                      attention_window=16), {}),
        ("speech-to-text", "speech", *h("Speech2TextForConditionalGeneration", "Speech2TextConfig", None,
                                        batch=speech_features_batch, **_S2S, input_feat_per_channel=16,
                                        num_conv_layers=2, conv_channels=64, max_source_positions=256,
                                        max_target_positions=64), {}),
        ("data2vec-audio-ctc", "speech", *h("Data2VecAudioForCTC", "Data2VecAudioConfig", None,
                                            batch=speech_ctc_batch, **_SPEECH), {}),
        # time series
        ("patchtst", "time-series", *h("PatchTSTForPrediction", "PatchTSTConfig", None, batch=patchtst_batch,
                                       num_input_channels=3, context_length=64, prediction_length=16, patch_length=8,
                                       patch_stride=8, d_model=64, num_hidden_layers=2, num_attention_heads=4,
                                       ffn_dim=128), {}),
        ("time-series-transformer", "time-series", *h(
            "TimeSeriesTransformerForPrediction", "TimeSeriesTransformerConfig", None, batch=time_series_batch,
            prediction_length=8, context_length=16, lags_sequence=[1, 2, 3], num_time_features=1, d_model=32,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layerdrop=0.0, decoder_layerdrop=0.0), {}),
        # plain torch
        ("weight-norm-mlp", "plain torch", hm.WeightNormMLP, plain_batch, plain_loss, {}),
        ("spectral-norm-cnn", "plain torch", hm.SpectralNormCNN, _image_tuple, plain_loss, {}),
        ("checkpoint-reentrant", "plain torch", functools.partial(hm.CheckpointedMLP, True), token_batch,
         plain_loss, {}),
        ("checkpoint-non-reentrant", "plain torch", functools.partial(hm.CheckpointedMLP, False), token_batch,
         plain_loss, {}),
        ("mha-need-weights", "plain torch", hm.MHAWeights, token_batch, plain_loss, {}),
        ("mha-need-weights-per-head", "plain torch", functools.partial(hm.MHAWeights, False), token_batch,
         plain_loss, {}),
        ("inplace-activations", "plain torch", hm.InplaceCNN, _image_tuple, plain_loss, {}),
        ("tuple-output", "plain torch", hm.TupleOutput, token_batch, hm.tuple_loss, {}),
        ("dict-output", "plain torch", hm.DictOutput, token_batch, hm.dict_loss, {}),
        ("buffer-updated-each-step", "plain torch", hm.RunningBuffer, token_batch, plain_loss, {}),
        ("embedding-bag", "plain torch", hm.EmbeddingBagModel, token_batch, plain_loss, {}),
        ("packed-bilstm", "plain torch", hm.PackedBiLSTM, token_batch, plain_loss, {}),
        ("unet-groupnorm-convtranspose", "plain torch", hm.TinyUNet, _image_tuple, plain_loss, {}),
        ("spatial-transformer-grid-sample", "plain torch", hm.SpatialTransformer, _image_tuple, plain_loss, {}),
        ("prototype-cdist", "plain torch", hm.PrototypeCdist, token_batch, plain_loss, {}),
        ("stft-audio", "plain torch", hm.STFTClassifier, wave_batch, plain_loss, {}),
        ("orthogonal-rnn", "plain torch", hm.OrthogonalRNN, token_batch, plain_loss, {}),
        ("max-unpool-autoencoder", "plain torch", hm.MaxUnpoolAutoencoder, _image_tuple, hm.reconstruction_loss, {}),
        ("llava-image-tokens", "multimodal", *h("LlavaForConditionalGeneration", "LlavaConfig", batch=llava_batch,
                                                **_LLAVA), {}),
    ]
    cases += heldout_cases4.cases()
    cases += heldout_cases5.cases()
    by_name = {c[0]: c for c in cases}
    for name in ("beit-rel-pos", "xlnet", "fnet-fft", "rwkv", "weight-norm-mlp", "speech-to-text", "packed-bilstm",
                 "esm-rotary"):
        cases.append((f"{name}-bf16mixed", *by_name[name][1:5], {"precision": "bf16-mixed"}))
    jobs = [  # other jobs than AdamW at batch 4 in Lightning's order
        ("biogpt", "sgd-momentum", {"optimizer": "sgd-momentum"}), ("funnel", "rmsprop", {"optimizer": "rmsprop"}),
        ("unet-groupnorm-convtranspose", "adagrad", {"optimizer": "adagrad"}),
        ("deepseek-v3-mla-moe", "ckpt", {"checkpointing": True}), ("longformer", "ckpt", {"checkpointing": True}),
        ("xlnet", "torch", {"loop": "torch"}), ("segformer", "b7", {"batch_size": 7}),
        ("m2m100", "16mixed", {"precision": "16-mixed"}),
        *heldout_cases4.JOBS,
        *heldout_cases5.JOBS,
    ]
    cases += [(f"{name}-{suffix}", *by_name[name][1:5], settings) for name, suffix, settings in jobs]
    return cases


CASES: dict[str, Case] = {
    name: Case(name=name, family=family, build=build, make_batch=make_batch, loss=loss, **{"batch_size": 4, **s})
    for name, family, build, make_batch, loss, s in _cases()
}


def estimate_one(name: str) -> dict:
    import benchmarks.realmodels as real

    case = CASES[name]
    if case.optimizer in SWEEP_OPTIMIZERS:  # memplan.estimate takes an optimizer outside its named ones as a callable
        case = dataclasses.replace(case, optimizer=SWEEP_OPTIMIZERS[case.optimizer])
    real.CASES[name] = case  # realmodels' estimate_one reads its own table
    return _estimate_one(name)


def run_case(name: str, module: str = "benchmarks.heldout_sweep", cases: dict | None = None) -> dict:
    """The case's truth and estimate, each in a fresh process of `module` (`--truth-one`, `--estimate-one`) that
    knows `cases` (default CASES); a failed build is told from a failed step."""
    truth, truth_wall, truth_error = _run_json([module, "--truth-one", name])
    est, est_wall, est_error = _run_json([module, "--estimate-one", name])
    case = (CASES if cases is None else cases)[name]
    setting = " ".join([case.precision, case.optimizer, f"b{case.batch_size}", *(["ckpt"] * case.checkpointing),
                        *(["torch order"] * (case.loop == "torch"))])
    row: dict[str, Any] = {"case": name, "family": case.family, "precision": case.precision, "setting": setting,
                           "truth": truth, "estimate": est["estimate"] if est else None,
                           "truth_process_seconds": round(truth_wall, 2),
                           "estimate_process_seconds": round(est_wall, 2)}
    compare(row, truth_error, est_error)
    return row


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" in r]
    magnitudes = [abs(r["error"]) for r in ok]
    worst = max(ok, key=lambda r: abs(r["error"]), default=None)
    return {
        "cases": len(rows), "compared": len(ok),
        "within_0.1%": sum(m <= WITHIN for m in magnitudes),
        "median_abs_error": statistics.median(magnitudes) if magnitudes else None,
        "worst_error": worst["error"] if worst else None, "worst_case": worst["case"] if worst else None,
        "estimate_failed": [r["case"] for r in rows if r.get("failed") == "estimate"],
        "truth_failed": [r["case"] for r in rows if r.get("failed") == "truth"],
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.3f}%"


def render_markdown(report: dict, *, title: str = "Held-out sweep: memplan on architectures outside realmodels.py",
                    about: str = "AdamW, batch 4.", cases=None, causes=None) -> str:
    """The report as markdown: `title`, the truth and estimate in a line ending in `about`, a row per case, the
    summary, the `cases` (default CASES) not in the report, and the `causes` lines (default CAUSES)."""
    m, s = report["machine"], report["summary"]
    lines = [
        f"# {title} (CPU)", "",
        f"{report['date']} · torch {m['torch']} · transformers {m['transformers']} · {m['cpu']}", "",
        ("Truth: a real Lightning `Trainer.fit`, profiler \"Total Allocated\" peak over build + 2 steps "
         "(benchmarks/cpu_truth.py). Estimate: `memplan.estimate(build, batch, device='cpu')`. "
         f"Error = (estimate - truth) / truth. {about}"), "",
        "| case | family | setting | truth MiB | memplan MiB | error | error bytes | truth peak in |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        t, e = r.get("truth"), r.get("estimate")
        setting = r.get("setting", r["precision"])
        if "error" not in r:
            msg = ((r.get("error_message") or "").strip().splitlines() or [""])[-1][:200].replace("|", "/")
            lines.append(f"| {r['case']} | {r['family']} | {setting} | | | failed ({r['failed']}) | {msg} | |")
            continue
        lines.append(f"| {r['case']} | {r['family']} | {setting} | {t['peak_allocated'] / MiB:.3f} "
                     f"| {e['peak_allocated'] / MiB:.3f} | {_pct(r['error'])} | {r['error_bytes']:+,} "
                     f"| {t['peak_phase']}: {(t['peak_op_stack'] or ['-'])[-1]} |")
    lines += ["", (f"{s['cases']} cases, {s['compared']} compared; within 0.1 %: {s['within_0.1%']}; "
              f"median |error| {_pct(s['median_abs_error'])}; worst {_pct(s['worst_error'])} ({s['worst_case']}); "
              f"estimate failed: {', '.join(s['estimate_failed']) or 'none'}; "
              f"truth failed (not counted): {', '.join(s['truth_failed']) or 'none'}.")]
    missing = [name for name in (CASES if cases is None else cases) if name not in {r["case"] for r in report["rows"]}]
    if missing:
        lines += ["", f"Defined but not run in this report: {', '.join(missing)}."]
    lines += ["", "## Misses and their causes", "", *(CAUSES if causes is None else causes)]
    return "\n".join(lines) + "\n"


def _previous(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _write(name: str, rows: list[dict], render=None) -> None:
    """results/NAME.{json,md}: the rows, dated, with their summary, rendered by `render` (default render_markdown)."""
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "rows": rows, "summary": summarize(rows)}
    write_results(name, report, (render or render_markdown)(report), indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE", help="run these cases only")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/ also with --only")
    parser.add_argument("--results", default="heldout_sweep", help="results/NAME.{json,md} to write")
    parser.add_argument("--merge", metavar="NAME", help="add results/NAME.json's rows to --results' and stop")
    parser.add_argument("--truth-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--estimate-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.truth_one or args.estimate_one:
        if args.truth_one:
            from benchmarks.cpu_truth import measure
            OPTIMIZERS.update(SWEEP_OPTIMIZERS)  # the truth builds these by name (zoo.make_optimizer), in its process
            out = measure(CASES[args.truth_one])
        else:
            out = estimate_one(args.estimate_one)
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    write = args.write or not args.only
    previous = _previous(args.results)
    kept = {r["case"]: r for r in previous.get("rows", []) if r["case"] in CASES} if args.only or args.merge else {}
    if args.merge:
        kept.update((r["case"], r) for r in _previous(args.merge)["rows"] if r["case"] in CASES)
        _write(args.results, [kept[n] for n in CASES if n in kept])
        return 0
    for name in args.only or list(CASES):
        row = kept[name] = run_case(name)
        status = _pct(row["error"]) if "error" in row else f"FAILED ({row['failed']}): {row['error_message'][-300:]}"
        print(f"{name:32s} truth {row['truth_process_seconds']:6.1f} s  estimate "
              f"{row['estimate_process_seconds']:6.1f} s  error {status}", flush=True)
        if write:  # after every case, so an interrupted run keeps what it measured
            _write(args.results, [kept[n] for n in CASES if n in kept])
    rows = [kept[n] for n in (args.only or CASES)]
    print(json.dumps(summarize(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
