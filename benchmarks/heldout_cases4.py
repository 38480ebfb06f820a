"""The fourth held-out sweep's cases (session 14; benchmarks/heldout_sweep.py adds them to its own): multimodal
decoders (Qwen2-VL's mrope, PaliGemma's prefix LM, BLIP-2's Q-Former), vision (Swin V2, ConvNeXt V2, Hiera,
Deformable DETR), text (ModernBERT unpadded, CANINE, Gemma 3, LFM2, xLSTM, Bamba, MoEs, Reformer, LongT5,
T5Gemma), speech and time series, and plain-torch training patterns (heldout_models4.py, heldout_models4b.py)."""
from __future__ import annotations

from benchmarks import heldout_inputs4 as hi4
from benchmarks import heldout_models4 as hm4
from benchmarks import heldout_models4b as hm4b
from benchmarks.heldout_inputs import _IMG, _image_tuple
from benchmarks.realmodels_cases import _DEC, _MOE, _hf_case
from benchmarks.realmodels_models import VOCAB, image_batch, plain_batch, plain_loss, seq2seq_batch, token_batch


def cases() -> list[tuple]:
    """(name, family, build, make_batch, loss, settings), as heldout_sweep._cases gives its own."""
    h = _hf_case
    return [
        # sweep4: multimodal
        ("qwen2-vl-mrope", "multimodal", *h("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", batch=hi4.qwen2vl_batch,
                                            **hi4._QWEN2VL), {}),
        ("paligemma-prefix-lm", "multimodal", *h("PaliGemmaForConditionalGeneration", "PaliGemmaConfig", "eager",
                                                 batch=hi4.paligemma_batch, **hi4._PALIGEMMA), {}),
        ("blip2-qformer", "multimodal", *h("Blip2ForConditionalGeneration", "Blip2Config", None,
                                           batch=hi4.blip2_batch, **hi4._BLIP2), {}),
        # sweep4: vision
        ("swinv2-cosine-attn", "vision", *h("Swinv2ForImageClassification", "Swinv2Config", None, batch=image_batch,
                                            image_size=32, patch_size=2, embed_dim=32, depths=[2, 2],
                                            num_heads=[2, 4], window_size=4, **_IMG), {}),
        ("convnextv2-grn", "cnn", *h("ConvNextV2ForImageClassification", "ConvNextV2Config", None, batch=image_batch,
                                     image_size=32, patch_size=2, hidden_sizes=[32, 64], depths=[2, 2],
                                     num_stages=2, **_IMG), {}),
        ("hiera-mask-unit", "vision", *h("HieraForImageClassification", "HieraConfig", None, batch=image_batch,
                                         image_size=[32, 32], patch_size=[3, 3], patch_stride=[2, 2],
                                         patch_padding=[1, 1], embed_dim=32, depths=[1, 2], num_heads=[1, 2],
                                         query_stride=[2, 2], masked_unit_size=[4, 4], num_query_pool=1,
                                         **_IMG), {}),
        ("deformable-detr", "detection", *h(
            "DeformableDetrForObjectDetection", "DeformableDetrConfig", None, batch=hi4.deformable_detr_batch,
            use_timm_backbone=False, use_pretrained_backbone=False,
            backbone_config={"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 32, 64],
                             "depths": [1, 1, 1, 1], "out_features": ["stage2", "stage3", "stage4"]},
            d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_queries=10, num_labels=5, auxiliary_loss=False,
            num_feature_levels=3, encoder_n_points=2, decoder_n_points=2), {}),
        # sweep4: text
        ("modernbert-unpadded", "encoder", *h("ModernBertForSequenceClassification", "ModernBertConfig", "sdpa",
                                              batch=hi4.modernbert_batch, vocab_size=VOCAB, hidden_size=128,
                                              intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                              global_attn_every_n_layers=2, local_attention=16, num_labels=4,
                                              pad_token_id=0), {}),
        ("canine-chars", "encoder", *h("CanineForSequenceClassification", "CanineConfig", None,
                                       batch=hi4.char_cls_batch, hidden_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=256, num_hash_buckets=1024,
                                       downsampling_rate=4, local_transformer_stride=32, num_labels=4), {}),
        ("gemma3-local-global", "decoder", *h("Gemma3ForCausalLM", "Gemma3TextConfig", "eager",
                                              **{**_DEC, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=32,
                                              sliding_window=16, layer_types=["sliding_attention",
                                                                              "sliding_attention",
                                                                              "full_attention"]), {}),
        ("lfm2-short-conv", "hybrid", *h("Lfm2ForCausalLM", "Lfm2Config", None, **_DEC, num_key_value_heads=2,
                                         layer_types=["conv", "full_attention"]), {}),
        ("xlstm", "recurrent", *h("xLSTMForCausalLM", "xLSTMConfig", None, vocab_size=VOCAB, hidden_size=128,
                                  embedding_dim=128, num_heads=4, num_blocks=2, use_cache=False,
                                  mode="train", chunk_size=16), {}),
        ("bamba-mamba2-hybrid", "hybrid", *h("BambaForCausalLM", "BambaConfig", None, **_DEC, num_key_value_heads=2,
                                             attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=32,
                                             mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16), {}),
        ("granite-moe", "moe", *h("GraniteMoeForCausalLM", "GraniteMoeConfig", **_MOE, num_local_experts=4), {}),
        ("phimoe-sparsemixer", "moe", *h("PhimoeForCausalLM", "PhimoeConfig", **_MOE, num_local_experts=4), {}),
        ("reformer-lsh-reversible", "encoder", *h(
            "ReformerModelWithLMHead", "ReformerConfig", None, batch=hi4.reformer_batch, vocab_size=VOCAB,
            hidden_size=64, attention_head_size=16, num_attention_heads=4, feed_forward_size=128,
            attn_layers=["local", "lsh"], axial_pos_shape=[8, 16], axial_pos_embds_dim=[32, 32],
            local_attn_chunk_length=16, lsh_attn_chunk_length=16, num_buckets=8, num_hashes=1, is_decoder=True,
            max_position_embeddings=128, use_cache=False, hidden_dropout_prob=0.0), {}),
        ("longt5-tglobal", "encoder-decoder", *h(
            "LongT5ForConditionalGeneration", "LongT5Config", None, batch=seq2seq_batch, vocab_size=VOCAB,
            d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
            encoder_attention_type="transient-global", local_radius=8, global_block_size=8, use_cache=False,
            decoder_start_token_id=0), {}),
        ("t5gemma", "encoder-decoder", *h("T5GemmaForConditionalGeneration", "T5GemmaConfig", "eager",
                                          batch=seq2seq_batch,
                                          encoder={**_DEC, "num_key_value_heads": 2, "head_dim": 32},
                                          decoder={**_DEC, "num_key_value_heads": 2, "head_dim": 32},
                                          vocab_size=VOCAB, use_cache=False), {}),
        # sweep4: speech, time series
        ("wav2vec2-bert-ctc", "speech", *h("Wav2Vec2BertForCTC", "Wav2Vec2BertConfig", None,
                                           batch=hi4.wav2vec2bert_batch, hidden_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=256,
                                           feature_projection_input_dim=160, conv_depthwise_kernel_size=7,
                                           vocab_size=32, pad_token_id=0,
                                           ctc_loss_reduction="mean", mask_time_prob=0.0, layerdrop=0.0,
                                           add_adapter=False), {}),
        ("patchtsmixer", "time-series", *h("PatchTSMixerForPrediction", "PatchTSMixerConfig", None,
                                           batch=hi4.patchtsmixer_batch, context_length=64, prediction_length=16,
                                           num_input_channels=3, patch_length=8, patch_stride=8, d_model=32,
                                           num_layers=2, mode="mix_channel", gated_attn=True,
                                           self_attn=True, self_attn_heads=2), {}),
        ("informer-probsparse", "time-series", *h(
            "InformerForPrediction", "InformerConfig", None, batch=hi4.informer_batch, prediction_length=16,
            context_length=32, lags_sequence=[1, 2, 3], num_time_features=1, d_model=32, encoder_layers=2,
            decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, attention_type="prob", sampling_factor=2, distil=True, encoder_layerdrop=0.0,
            decoder_layerdrop=0.0), {}),
        # sweep4: plain torch training patterns
        ("custom-function-saves-views", "plain torch", hm4.CustomFunctionViews, token_batch, plain_loss, {}),
        ("gradient-penalty-double-backward", "plain torch", hm4.Critic, plain_batch, hm4.gradient_penalty_loss, {}),
        ("infonce-label-smoothing-b512", "plain torch", hm4.TwoTower, hm4.contrastive_batch, hm4.info_nce_loss,
         {"batch_size": 512}),
        ("focal-loss-segmentation", "plain torch", hm4.SegNet, hm4.seg_batch, hm4.focal_loss, {}),
        ("ema-buffers-foreach-lerp", "plain torch", hm4.EMAModel, token_batch, plain_loss, {}),
        ("tied-weight-three-modules", "plain torch", hm4.TiedThree, token_batch, hm4.tied_loss, {}),
        ("channels-last-cnn-bf16mixed", "plain torch", hm4.ChannelsLastCNN, _image_tuple, plain_loss,
         {"precision": "bf16-mixed"}),
        ("nested-mixed-checkpoint", "plain torch", hm4.NestedCheckpoint, token_batch, plain_loss, {}),
        ("backward-in-loss-microbatches", "plain torch", hm4.BackwardInLoss, plain_batch, hm4.microbatch_loss,
         {"batch_size": 64}),
        ("weight-clip-inplace-param-view", "plain torch", hm4.ClippedCritic, plain_batch, plain_loss, {}),
        ("video-conv3d", "plain torch", hm4b.VideoConv3d, hm4b.video_batch, plain_loss, {}),
        ("dilated-conv-pixelshuffle-fracpool", "plain torch", hm4b.DilatedCNN, _image_tuple, plain_loss, {}),
        ("fno-complex-weights", "plain torch", hm4b.FNO, _image_tuple, plain_loss, {}),
        ("embedding-max-norm", "plain torch", hm4b.MaxNormEmbedding, token_batch, plain_loss, {}),
        ("boolean-mask-token-pruning", "plain torch", hm4b.BooleanMaskSelect, token_batch, plain_loss, {}),
        ("jit-script-inside", "plain torch", hm4b.JitScripted, token_batch, plain_loss, {}),
        ("qat-learnable-fake-quant", "plain torch", hm4b.QATLinear, plain_batch, plain_loss, {}),
        ("cumprod-logcumsumexp-cummax", "plain torch", hm4b.CumulativeOps, token_batch, plain_loss, {}),
        ("vae-rsample-gumbel", "plain torch", hm4b.VAE, plain_batch, hm4b.vae_loss, {}),
        ("bicubic-antialias-resize", "plain torch", hm4b.Upsampler, _image_tuple, plain_loss, {}),
        ("jacobian-vmap-jacrev", "plain torch", hm4.Critic, plain_batch, hm4b.jacobian_loss, {}),
    ]


JOBS = [  # (case, suffix, settings): other jobs than AdamW at batch 4 in Lightning's order
    ("tied-weight-three-modules", "lion", {"optimizer": "lion"}),
    ("custom-function-saves-views", "adafactor", {"optimizer": "adafactor"}),
    ("ema-buffers-foreach-lerp", "sgd-for-loop", {"optimizer": "sgd-momentum-for-loop"}),
    ("swinv2-cosine-attn", "bf16mixed", {"precision": "bf16-mixed"}),
    ("gemma3-local-global", "bf16mixed-ckpt", {"precision": "bf16-mixed", "checkpointing": True}),
    ("qwen2-vl-mrope", "ckpt", {"checkpointing": True}),
    ("granite-moe", "torch", {"loop": "torch"}),
]
