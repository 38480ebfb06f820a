"""The fifth held-out sweep's cases (session 15; benchmarks/heldout_sweep.py adds them to its own): decoders and MoEs
not covered before (DBRX, Nemotron, GPT-Neo local attention, Persimmon, OLMo 2, DiffLlama, JetMoE, MiniMax lightning
attention, Zamba), encoders (DeBERTa v1, RoFormer, MobileBERT, MRA), encoder-decoders (ProphetNet, Pegasus-X, UMT5,
NLLB-MoE), vision (DINOv2 with registers, PVT v2, SwiftFormer, MobileViT v2, Data2Vec vision, UperNet,
Swin2SR, TimeSformer), speech (WavLM, SEW-D, Wav2Vec2-Conformer, AST, Whisper classifier), time series (Autoformer,
TimesFM) and plain-torch training patterns (heldout_models5.py); optimizers beyond the earlier ones."""
from __future__ import annotations

import functools

import torch

from benchmarks import heldout_inputs4 as hi4
from benchmarks import heldout_inputs5 as hi5
from benchmarks import heldout_models5 as hm5
from benchmarks.heldout_inputs import _IMG, _S2S, _SPEECH, _image_tuple
from benchmarks.realmodels_cases import _DEC, _ENC, _MOE, _VIT, _hf_case
from benchmarks.realmodels_models import (
    VOCAB,
    _hf,
    cls_batch,
    image_batch,
    plain_batch,
    plain_loss,
    seq2seq_batch,
    speech_ctc_batch,
    token_batch,
)

OPTIMIZERS = {
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-3),
    "radam-decoupled": lambda params: torch.optim.RAdam(params, lr=1e-3, decoupled_weight_decay=True),
    "adamax": lambda params: torch.optim.Adamax(params, lr=1e-3),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=1e-3, amsgrad=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "adadelta": lambda params: torch.optim.Adadelta(params),
    "rprop": lambda params: torch.optim.Rprop(params, lr=1e-3),
    "asgd": lambda params: torch.optim.ASGD(params, lr=1e-2),
    "sgd-nesterov-wd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
}
"""Optimizers the sweep5 cases use besides benchmarks.zoo.OPTIMIZERS (heldout_sweep.SWEEP_OPTIMIZERS, which it reads
for both the truth and the estimate)."""


def cases() -> list[tuple]:
    """(name, family, build, make_batch, loss, settings), as heldout_sweep._cases gives its own."""
    h = _hf_case
    return [
        # sweep5: decoders, MoEs, hybrids
        ("dbrx-moe-clip-qkv", "moe", *h("DbrxForCausalLM", "DbrxConfig", None, vocab_size=VOCAB, d_model=128,
                                        n_heads=4, n_layers=2, max_seq_len=256, use_cache=False,
                                        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                                        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4,
                                                    "moe_top_k": 2}), {}),
        ("nemotron-relu2-ln1p", "decoder", *h("NemotronForCausalLM", "NemotronConfig", **_DEC,
                                              num_key_value_heads=2, partial_rotary_factor=0.5), {}),
        ("gpt-neo-local-global", "decoder", *h("GPTNeoForCausalLM", "GPTNeoConfig", None, vocab_size=VOCAB,
                                               hidden_size=128, num_layers=2, num_heads=4,
                                               attention_types=[[["global", "local"], 1]], window_size=16,
                                               max_position_embeddings=256, use_cache=False), {}),
        ("persimmon-qk-layernorm", "decoder", *h("PersimmonForCausalLM", "PersimmonConfig", None, **_DEC,
                                                 qk_layernorm=True, partial_rotary_factor=0.5), {}),
        ("olmo2-post-norm-qk", "decoder", *h("Olmo2ForCausalLM", "Olmo2Config", **_DEC, num_key_value_heads=2), {}),
        ("diffllama-differential", "decoder", *h("DiffLlamaForCausalLM", "DiffLlamaConfig", "eager", **_DEC,
                                                 num_key_value_heads=2), {}),
        ("jetmoe-attention-experts", "moe", *h("JetMoeForCausalLM", "JetMoeConfig", None, vocab_size=VOCAB,
                                               hidden_size=128, num_hidden_layers=2, num_key_value_heads=2,
                                               kv_channels=32, intermediate_size=128, num_local_experts=4,
                                               num_experts_per_tok=2, max_position_embeddings=256,
                                               use_cache=False), {}),
        ("minimax-lightning-attn", "hybrid", *h("MiniMaxForCausalLM", "MiniMaxConfig", "eager", **_MOE,
                                                num_local_experts=4, head_dim=32, block_size=16,
                                                layer_types=["linear_attention", "full_attention"]), {}),
        # sweep5: encoders
        ("deberta-v1-disentangled", "encoder", *h("DebertaForSequenceClassification", "DebertaConfig", None,
                                                  batch=cls_batch, **_ENC, relative_attention=True,
                                                  pos_att_type=["c2p", "p2c"], max_relative_positions=64), {}),
        ("roformer-rotary", "encoder", *h("RoFormerForSequenceClassification", "RoFormerConfig", None,
                                          batch=cls_batch, **_ENC, embedding_size=128), {}),
        ("mobilebert-bottleneck", "encoder", *h("MobileBertForSequenceClassification", "MobileBertConfig", None,
                                                batch=cls_batch, **{**_ENC, "hidden_size": 256},
                                                embedding_size=64, intra_bottleneck_size=64,
                                                true_hidden_size=64, num_feedforward_networks=2), {}),
        ("mra-multiresolution", "encoder", *h("MraForSequenceClassification", "MraConfig", None,
                                              batch=functools.partial(cls_batch, seq_len=128),
                                              **{**_ENC, "max_position_embeddings": 130}, block_per_row=2,
                                              approx_mode="full"), {}),
        # sweep5: encoder-decoders
        ("prophetnet-ngram", "encoder-decoder", *h("ProphetNetForConditionalGeneration", "ProphetNetConfig", None,
                                                   batch=hi5.prophetnet_batch, vocab_size=VOCAB, hidden_size=128,
                                                   encoder_ffn_dim=256, decoder_ffn_dim=256, num_encoder_layers=2,
                                                   num_decoder_layers=2, num_encoder_attention_heads=4,
                                                   num_decoder_attention_heads=4, ngram=2, num_buckets=32,
                                                   relative_max_distance=64, max_position_embeddings=128,
                                                   use_cache=False, decoder_start_token_id=2), {}),
        ("pegasus-x-block-global", "encoder-decoder", *h(
            "PegasusXForConditionalGeneration", "PegasusXConfig", None, batch=seq2seq_batch, **_S2S,
            max_position_embeddings=256, block_size=16, num_global_tokens=8, stagger_local_blocks=True), {}),
        ("umt5-per-layer-bias", "encoder-decoder", *h("UMT5ForConditionalGeneration", "UMT5Config", None,
                                                      batch=seq2seq_batch, vocab_size=VOCAB, d_model=128, d_kv=32,
                                                      d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
                                                      use_cache=False, decoder_start_token_id=0), {}),
        ("nllb-moe-top2", "moe", *h("NllbMoeForConditionalGeneration", "NllbMoeConfig", None,
                                    batch=seq2seq_batch, **_S2S, max_position_embeddings=256, num_experts=4,
                                    expert_capacity=64, encoder_sparse_step=2, decoder_sparse_step=2,
                                    router_z_loss_coef=0.001, router_aux_loss_coef=0.001), {}),
        # sweep5: vision
        ("dinov2-registers", "vision", *h("Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersConfig",
                                          None, batch=image_batch, **_VIT, num_register_tokens=4), {}),
        ("pvt-v2-sr-attn", "vision", *h("PvtV2ForImageClassification", "PvtV2Config", None, batch=image_batch,
                                        image_size=32, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                        hidden_sizes=[32, 64], patch_sizes=[7, 3], strides=[4, 2],
                                        num_attention_heads=[1, 2], mlp_ratios=[2, 2], **_IMG), {}),
        ("swiftformer", "vision", *h("SwiftFormerForImageClassification", "SwiftFormerConfig", None,
                                     batch=image_batch, depths=[1, 1, 1, 1], embed_dims=[16, 32, 48, 64], **_IMG), {}),
        ("mobilevitv2-linear-attn", "vision", *h("MobileViTV2ForImageClassification", "MobileViTV2Config", None,
                                                 batch=functools.partial(image_batch, size=64), image_size=64,
                                                 width_multiplier=0.5, **_IMG), {}),
        ("data2vec-vision-relpos", "vision", *h("Data2VecVisionForImageClassification", "Data2VecVisionConfig", None,
                                                batch=image_batch, **_VIT, use_relative_position_bias=True,
                                                use_mean_pooling=True, layer_scale_init_value=0.1), {}),
        ("upernet-convnext-seg", "segmentation", *h(
            "UperNetForSemanticSegmentation", "UperNetConfig", None, batch=hi5.seg_batch,
            backbone_config={"model_type": "convnext", "hidden_sizes": [16, 32, 64, 64], "depths": [1, 1, 1, 1],
                             "out_features": ["stage1", "stage2", "stage3", "stage4"]},
            hidden_size=32, auxiliary_channels=16, num_labels=5, use_auxiliary_head=True), {}),
        ("segformer-semantic-seg", "segmentation", *h(
            "SegformerForSemanticSegmentation", "SegformerConfig", None, batch=hi5.seg_batch, num_encoder_blocks=2,
            depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64], patch_sizes=[7, 3], strides=[4, 2],
            num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=64, num_labels=5), {}),
        ("swin2sr-x2", "vision", functools.partial(
            _hf, "Swin2SRForImageSuperResolution",
            "Swin2SRConfig", None, image_size=16, embed_dim=32, depths=[1, 1], num_heads=[2, 2], window_size=4,
            upscale=2, upsampler="pixelshuffle", mlp_ratio=2.0), hi5.sr_batch, hi5.sr_loss, {}),
        ("timesformer-divided", "video", *h("TimesformerForVideoClassification", "TimesformerConfig", None,
                                            batch=hi5.video_batch, **_VIT, num_frames=4,
                                            attention_type="divided_space_time"), {}),
        # sweep5: speech
        ("wavlm-gated-relpos-ctc", "speech", *h("WavLMForCTC", "WavLMConfig", None, batch=speech_ctc_batch,
                                                **_SPEECH, num_buckets=64, max_bucket_distance=128), {}),
        ("sew-d-ctc", "speech", *h("SEWDForCTC", "SEWDConfig", None, batch=speech_ctc_batch,
                                   **{**_SPEECH, "hidden_size": 128}, squeeze_factor=2, max_position_embeddings=256,
                                   position_buckets=64), {}),
        ("w2v2-conformer-rotary-ctc", "speech", *h("Wav2Vec2ConformerForCTC", "Wav2Vec2ConformerConfig", None,
                                                   batch=speech_ctc_batch, **_SPEECH,
                                                   position_embeddings_type="rotary",
                                                   conv_depthwise_kernel_size=7), {}),
        ("ast-audio-cls", "speech", *h("ASTForAudioClassification", "ASTConfig", None, batch=hi5.ast_batch,
                                       hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=256, patch_size=8, frequency_stride=8, time_stride=8,
                                       max_length=64, num_mel_bins=32, num_labels=4), {}),
        ("whisper-encoder-cls", "speech", *h("WhisperForAudioClassification", "WhisperConfig", None,
                                             batch=hi5.whisper_cls_batch, **{**_S2S, "num_mel_bins": 16},
                                             max_source_positions=64, num_labels=4), {}),
        # sweep5: time series
        ("autoformer-autocorr", "time-series", *h(
            "AutoformerForPrediction", "AutoformerConfig", None, batch=hi4.informer_batch, prediction_length=16,
            context_length=32, lags_sequence=[1, 2, 3], num_time_features=1, d_model=32, encoder_layers=2,
            decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, moving_average=5, autocorrelation_factor=2, encoder_layerdrop=0.0,
            decoder_layerdrop=0.0), {}),
        ("timesfm", "time-series", *h("TimesFmModelForPrediction", "TimesFmConfig", None, batch=hi5.timesfm_batch,
                                      patch_length=16, context_length=64, horizon_length=32, hidden_size=64,
                                      intermediate_size=128, head_dim=16, num_attention_heads=4,
                                      num_hidden_layers=2), {}),
        # sweep5: plain torch training patterns
        ("transformer-masks-label-smooth", "plain torch", hm5.Seq2SeqTransformer, hi5.seq2seq_tuple,
         hi5.seq2seq_loss, {}),
        ("mha-seq-first-kdim-padmask", "plain torch", hm5.SeqFirstMHA, hi5.padded_tokens, plain_loss, {}),
        ("conv-bigru-ctc", "plain torch", hm5.ConvCTC, hi5.ctc_batch, hi5.ctc_loss, {}),
        ("lstm-proj-adaptive-softmax", "plain torch", hm5.LSTMProjAdaptiveSoftmax, hi5.lm_tuple,
         hi5.adaptive_softmax_loss, {}),
        ("sparse-embedding-bag-sgd", "plain torch", hm5.SparseEmbeddingBag, hi5.sparse_batch, hi5.sparse_loss,
         {"optimizer": "sgd"}),
        ("gnn-index-add-scatter", "plain torch", hm5.MessagePassing, hi5.graph_batch, hi5.graph_loss, {}),
        ("listmle-sort-topk", "plain torch", hm5.Scorer, hi5.ranking_batch, hi5.listmle_loss, {}),
        ("shufflenet-drop-path", "plain torch", hm5.ShuffleNetDropPath, _image_tuple, plain_loss, {}),
        ("unfold-fold-instnorm-rrelu", "plain torch", hm5.UnfoldFoldNet, _image_tuple, plain_loss, {}),
        ("grad-hooks-where-loss", "plain torch", hm5.HookedMLP, plain_batch, hi5.robust_loss, {}),
        ("sdpa-bool-mask-dropout", "plain torch", hm5.SDPABoolMaskDropout, hi5.padded_tokens, plain_loss, {}),
        ("einsum-chain-bilinear", "plain torch", hm5.EinsumBilinear, token_batch, plain_loss, {}),
        ("complex-weights-rfft", "plain torch", hm5.ComplexLinear, token_batch, plain_loss, {}),
        ("convtranspose3d-ae-trilinear", "plain torch", hm5.ConvTranspose3dAE, hm5.volume_batch,
         hm5.reconstruction_loss, {}),
        ("pixel-unshuffle-lrn-mish", "plain torch", hm5.PixelUnshuffleNet, _image_tuple, plain_loss, {}),
        ("sparse-coo-adjacency-gcn", "plain torch", hm5.SparseAdjacencyGCN, hi5.graph_batch, hi5.graph_loss, {}),
        ("quantile-median-kthvalue", "plain torch", hm5.QuantileMedianHead, token_batch, plain_loss, {}),
        ("dirichlet-lgamma-digamma", "plain torch", hm5.DirichletHead, plain_batch, hm5.dirichlet_loss, {}),
        ("unique-inverse-tokens", "plain torch", hm5.UniqueTokens, token_batch, plain_loss, {}),
    ]


JOBS = [  # (case, suffix, settings): other jobs than AdamW at batch 4 in Lightning's order
    ("olmo2-post-norm-qk", "nadam", {"optimizer": "nadam"}),
    ("roformer-rotary", "radam", {"optimizer": "radam-decoupled"}),
    ("dinov2-registers", "adamax", {"optimizer": "adamax"}),
    ("shufflenet-drop-path", "amsgrad", {"optimizer": "adam-amsgrad"}),
    ("grad-hooks-where-loss", "adamw-fused", {"optimizer": "adamw-fused"}),
    ("einsum-chain-bilinear", "adadelta", {"optimizer": "adadelta"}),
    ("gnn-index-add-scatter", "rprop", {"optimizer": "rprop"}),
    ("listmle-sort-topk", "asgd", {"optimizer": "asgd"}),
    ("swiftformer", "nesterov", {"optimizer": "sgd-nesterov-wd"}),
    ("transformer-masks-label-smooth", "bf16mixed", {"precision": "bf16-mixed"}),
    ("conv-bigru-ctc", "bf16mixed", {"precision": "bf16-mixed"}),
    ("deberta-v1-disentangled", "ckpt", {"checkpointing": True}),
    ("wavlm-gated-relpos-ctc", "16mixed", {"precision": "16-mixed"}),
    ("pvt-v2-sr-attn", "bf16true", {"precision": "bf16-true"}),
    ("mobilevitv2-linear-attn", "b7-torch", {"batch_size": 7, "loop": "torch"}),
]
