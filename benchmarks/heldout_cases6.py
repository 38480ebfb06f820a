"""The sixth held-out sweep's cases (benchmarks/heldout_sweep6_run.py runs them): decoders and hybrids not covered
before (GPT-1, CTRL, GLM-4, SmolLM3 NoPE layers, Cohere2, Falcon-H1, FalconMamba, Zamba2 shared blocks, Qwen3-Next
gated delta net, Llama 4 chunked attention + MoE, GLM-4 MoE, BitNet), encoders (XLM-RoBERTa-XL, I-BERT integer
mode, X-MOD adapters, RemBERT, LayoutLM boxes, YOSO), vision (BiT weight standardization, CvT, I-JEPA, SigLIP,
GLPN, DPT, ImageGPT, YOLOS), speech and audio (UniSpeech-SAT, SEW, SpeechT5 with and without LayerDrop, Encodec,
DAC, MusicGen, Moonshine), multimodal (ViLT, GIT), Decision Transformer, plain-torch training patterns and
batch structures (heldout_models6.py, heldout_inputs6.py) and optimizers beyond the earlier sweeps'."""
from __future__ import annotations

import functools

import torch

from benchmarks import heldout_inputs6 as hi6
from benchmarks import heldout_models6 as hm6
from benchmarks.heldout_inputs import _IMG, _SPEECH, _image_tuple
from benchmarks.realmodels_cases import _DEC, _ENC, _MOE, _VIT, _hf_case
from benchmarks.realmodels_models import (
    VOCAB,
    _hf,
    cls_batch,
    image_batch,
    plain_batch,
    plain_loss,
    plain_mlp,
    speech_ctc_batch,
)

CONFIGURE = "configure"
"""The optimizer name of a LightningModule case whose configure_optimizers is used (None to memplan and to the
truth's Training)."""

OPTIMIZERS = {
    "adam-for-loop": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=False),
    "sgd-dampening": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1),
    "lbfgs": lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=2, history_size=4),
    "adamw-maximize-wd": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, maximize=True),
    "adagrad-lr-decay": lambda params: torch.optim.Adagrad(params, lr=1e-2, lr_decay=1e-3, weight_decay=1e-4),
}
"""Optimizers the sweep6 cases use besides benchmarks.zoo.OPTIMIZERS and the earlier sweeps' (read by the runner
for both the truth and the estimate)."""
_SPEECHT5 = {**{k: v for k, v in _SPEECH.items()
                if k not in ("num_hidden_layers", "intermediate_size", "num_attention_heads")}, "vocab_size": VOCAB}


def cases() -> list[tuple]:
    """(name, family, build, make_batch, loss, settings), as heldout_sweep._cases gives its own."""
    h = _hf_case
    return [
        # decoders and hybrids
        ("openai-gpt-postln", "decoder", *h("OpenAIGPTLMHeadModel", "OpenAIGPTConfig", None, vocab_size=VOCAB,
                                            n_embd=128, n_layer=2, n_head=4, n_positions=256), {}),
        ("ctrl-sinusoidal", "decoder", *h("CTRLLMHeadModel", "CTRLConfig", None, vocab_size=VOCAB, n_embd=128,
                                          dff=256, n_layer=2, n_head=4, n_positions=256, use_cache=False), {}),
        ("glm4-partial-rotary", "decoder", *h("Glm4ForCausalLM", "Glm4Config", **_DEC, num_key_value_heads=2,
                                              pad_token_id=0, head_dim=32), {}),
        ("smollm3-nope-layers", "decoder", *h("SmolLM3ForCausalLM", "SmolLM3Config", **_DEC, num_key_value_heads=2,
                                              pad_token_id=0, no_rope_layer_interval=2), {}),
        ("cohere2-sliding-global", "decoder", *h("Cohere2ForCausalLM", "Cohere2Config", **_DEC,
                                                 num_key_value_heads=2, sliding_window=16,
                                                 layer_types=["sliding_attention", "full_attention"]), {}),
        ("falcon-h1-hybrid", "hybrid", *h("FalconH1ForCausalLM", "FalconH1Config", None, **_DEC, num_key_value_heads=2,
                                          head_dim=32, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                                          mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16), {}),
        ("falcon-mamba", "state-space", *h("FalconMambaForCausalLM", "FalconMambaConfig", None, vocab_size=VOCAB,
                                           hidden_size=128, state_size=8, num_hidden_layers=2, use_cache=False,
                                           use_mambapy=False), {}),
        ("zamba2-shared-blocks", "hybrid", *h("Zamba2ForCausalLM", "Zamba2Config", None,
                                              **{**_DEC, "num_hidden_layers": 3}, num_key_value_heads=4,
                                              mamba_d_state=16, mamba_headdim=32, n_mamba_heads=8, mamba_ngroups=1,
                                              chunk_size=16, layers_block_type=["hybrid", "mamba", "hybrid"],
                                              num_mem_blocks=1, use_mem_rope=True, adapter_rank=8,
                                              use_shared_attention_adapter=True), {}),
        ("qwen3-next-deltanet-moe", "hybrid", *h(
            "Qwen3NextForCausalLM", "Qwen3NextConfig", None, **_MOE, head_dim=32, num_experts=4,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"]), {}),
        ("llama4-chunked-moe", "moe", *h("Llama4ForCausalLM", "Llama4TextConfig", "eager", **_MOE, head_dim=32,
                                         intermediate_size_mlp=256, num_local_experts=4, interleave_moe_layer_step=2,
                                         attention_chunk_size=16, no_rope_layers=[1, 0]), {}),
        ("glm4-moe-shared-expert", "moe", *h("Glm4MoeForCausalLM", "Glm4MoeConfig", **_MOE, head_dim=32,
                                             moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=1, topk_group=1), {}),
        ("bitnet-ternary", "decoder", *h("BitNetForCausalLM", "BitNetConfig", **_DEC, num_key_value_heads=2), {}),
        # encoders
        ("xlm-roberta-xl-preln", "encoder", *h("XLMRobertaXLForSequenceClassification", "XLMRobertaXLConfig", None,
                                               batch=cls_batch, **{**_ENC, "max_position_embeddings": 258}), {}),
        ("ibert-integer-mode", "encoder", *h("IBertForSequenceClassification", "IBertConfig", None, batch=cls_batch,
                                             **{**_ENC, "max_position_embeddings": 258}, quant_mode=True), {}),
        ("xmod-lang-adapters", "encoder", *h("XmodForSequenceClassification", "XmodConfig", None,
                                             batch=hi6.xmod_batch, **{**_ENC, "max_position_embeddings": 258},
                                             languages=["en_XX", "de_DE"], default_language="en_XX"), {}),
        ("rembert-decoupled-emb", "encoder", *h("RemBertForSequenceClassification", "RemBertConfig", None,
                                                batch=cls_batch, **_ENC, input_embedding_size=64,
                                                output_embedding_size=192), {}),
        ("layoutlm-bbox", "encoder", *h("LayoutLMForSequenceClassification", "LayoutLMConfig", None,
                                        batch=hi6.layoutlm_batch, **_ENC), {}),
        ("yoso-expectation", "encoder", *h("YosoForSequenceClassification", "YosoConfig", None, batch=cls_batch,
                                           **{**_ENC, "max_position_embeddings": 258}, use_expectation=True,
                                           conv_window=None), {}),
        # vision
        ("bit-weight-std", "cnn", *h("BitForImageClassification", "BitConfig", None, batch=image_batch,
                                     embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], layer_type="bottleneck",
                                     global_padding="SAME", num_groups=8, **_IMG), {}),
        ("cvt-conv-attn", "vision", *h("CvtForImageClassification", "CvtConfig", None, batch=image_batch,
                                       embed_dim=[32, 64], num_heads=[1, 2], depth=[1, 2], patch_sizes=[7, 3],
                                       patch_stride=[4, 2], patch_padding=[2, 1], mlp_ratio=[2.0, 2.0],
                                       attention_drop_rate=[0.0, 0.0], drop_rate=[0.0, 0.0],
                                       drop_path_rate=[0.0, 0.0], qkv_bias=[True, True], cls_token=[False, True],
                                       qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3],
                                       padding_kv=[1, 1], stride_kv=[2, 2], padding_q=[1, 1], stride_q=[1, 1],
                                       **_IMG), {}),
        ("ijepa-mean-pool", "vision", *h("IJepaForImageClassification", "IJepaConfig", None, batch=image_batch,
                                         **_VIT), {}),
        ("siglip-sigmoid-loss", "multimodal", *h(
            "SiglipModel", "SiglipConfig", None, batch=hi6.contrastive_batch,
            text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=16),
            vision_config=dict(image_size=32, patch_size=4, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4)), {}),
        ("glpn-depth-silog", "depth", *h("GLPNForDepthEstimation", "GLPNConfig", None, batch=hi6.depth_batch,
                                         num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64],
                                         patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                                         mlp_ratios=[2, 2], decoder_hidden_size=32), {}),
        ("dpt-depth-l1", "depth", functools.partial(
            _hf, "DPTForDepthEstimation", "DPTConfig", None, image_size=64, patch_size=8, hidden_size=64,
            num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, backbone_out_indices=[0, 1, 2, 3],
            neck_hidden_sizes=[16, 32, 64, 64], fusion_hidden_size=32, head_in_index=-1),
         hi6.depth_batch, hi6.depth_l1_loss, {}),
        ("imagegpt-pixels", "decoder", *h("ImageGPTForCausalImageModeling", "ImageGPTConfig", None,
                                          batch=hi6.imagegpt_batch, vocab_size=65, n_positions=256, n_embd=64,
                                          n_layer=2, n_head=4, use_cache=False), {}),
        ("yolos-hungarian", "detection", *h("YolosForObjectDetection", "YolosConfig", None, batch=hi6.yolos_batch,
                                            **{**_VIT, "image_size": [32, 32], "num_labels": 5},
                                            num_detection_tokens=10), {}),
        # speech and audio
        ("unispeech-sat-ctc", "speech", *h("UniSpeechSatForCTC", "UniSpeechSatConfig", None,
                                           batch=speech_ctc_batch, **_SPEECH), {}),
        ("sew-squeeze-ctc", "speech", *h("SEWForCTC", "SEWConfig", None, batch=speech_ctc_batch, **_SPEECH,
                                         squeeze_factor=2), {}),
        ("speecht5-asr", "speech", *h("SpeechT5ForSpeechToText", "SpeechT5Config", None, batch=hi6.wave_text_batch,
                                      **_SPEECHT5,
                                      encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                                      max_speech_positions=512, max_text_positions=64, use_cache=False,
                                      decoder_start_token_id=2), {}),
        ("speecht5-asr-no-layerdrop", "speech", *h(
            "SpeechT5ForSpeechToText", "SpeechT5Config", None, batch=hi6.wave_text_batch, **_SPEECHT5,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=256, decoder_ffn_dim=256, max_speech_positions=512, max_text_positions=64,
            use_cache=False, decoder_start_token_id=2, encoder_layerdrop=0.0, decoder_layerdrop=0.0), {}),
        ("encodec-recon", "audio", functools.partial(
            _hf, "EncodecModel", "EncodecConfig", None, num_filters=8, hidden_size=32, upsampling_ratios=[4, 4],
            codebook_size=64, codebook_dim=32, num_lstm_layers=1, target_bandwidths=[6.0],
            sampling_rate=8000), hi6.codec_batch, hi6.codec_recon_loss, {}),
        ("dac-vq-recon", "audio", functools.partial(
            _hf, "DacModel", "DacConfig", None, encoder_hidden_size=8, downsampling_ratios=[2, 4],
            decoder_hidden_size=64,
            n_codebooks=2, codebook_size=64, codebook_dim=8, hidden_size=64), hi6.codec_batch, hi6.codec_recon_loss,
         {}),
        ("musicgen-decoder-codebooks", "audio", *h("MusicgenForCausalLM", "MusicgenDecoderConfig", None,
                                                   batch=hi6.musicgen_batch, vocab_size=128, hidden_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4, ffn_dim=256,
                                                   num_codebooks=4, max_position_embeddings=64, use_cache=False), {}),
        ("moonshine-asr", "speech", *h("MoonshineForConditionalGeneration", "MoonshineConfig", None,
                                       batch=hi6.wave_text_batch, vocab_size=VOCAB, hidden_size=64,
                                       intermediate_size=128, encoder_num_hidden_layers=2, decoder_num_hidden_layers=2,
                                       encoder_num_attention_heads=4, decoder_num_attention_heads=4,
                                       max_position_embeddings=256, use_cache=False, decoder_start_token_id=1,
                                       pad_token_id=0), {}),
        # multimodal and control
        ("vilt-vqa-soft-labels", "multimodal", *h("ViltForQuestionAnswering", "ViltConfig", None, batch=hi6.vilt_batch,
                                                  vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=128, image_size=32,
                                                  patch_size=8, max_position_embeddings=40, num_labels=8,
                                                  max_image_length=-1), {}),
        ("git-captioning", "multimodal", *h("GitForCausalLM", "GitConfig", None, batch=hi6.git_batch,
                                            vision_config=dict(image_size=32, patch_size=8, hidden_size=64,
                                                               intermediate_size=128, num_hidden_layers=2,
                                                               num_attention_heads=4),
                                            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            max_position_embeddings=64), {}),
        ("decision-transformer", "rl", functools.partial(
            _hf, "DecisionTransformerModel", "DecisionTransformerConfig", None, state_dim=11, act_dim=3,
            hidden_size=64, n_layer=2, n_head=4, max_ep_len=64, n_positions=128),
         hi6.decision_batch, hi6.decision_loss, {}),
        # plain torch training patterns
        ("teacher-student-kd-nograd", "plain torch", hm6.TeacherStudent, hi6.padded_ids_batch, hm6.distill_loss, {}),
        ("frozen-backbone-head", "plain torch", hm6.FrozenBackbone, _image_tuple, plain_loss, {}),
        ("lora-frozen-base", "plain torch", hm6.LoRATransformer, hi6.padded_ids_batch, plain_loss, {}),
        ("param-groups-configure", "lightning", hm6.ParamGroupsModule, plain_batch, None,
         {"optimizer": CONFIGURE}),
        ("clip-two-tower-b256", "plain torch", hm6.TwoTowerCLIP, hi6.clip_tower_batch, hm6.clip_loss,
         {"batch_size": 256}),
        ("triplet-shared-encoder", "plain torch", hm6.TripletEncoder, hi6.triplet_batch, hm6.triplet_loss, {}),
        ("moco-queue-momentum", "plain torch", hm6.MoCo, hi6.two_views, hi6.view_loss, {}),
        ("multitask-two-heads", "plain torch", hm6.MultiTask, hi6.multitask_batch, hm6.multitask_loss, {}),
        ("manual-retain-graph", "lightning", hm6.RetainGraphModule, hi6.multitask_batch, None,
         {"optimizer": CONFIGURE}),
        ("manual-gan-two-opt-sched", "lightning", hm6.TwoOptimizerGAN, plain_batch, None,
         {"optimizer": CONFIGURE, "batch_size": 32}),
        ("where-gather-index-select", "plain torch", hm6.WhereGather, hi6.padded_ids_batch, plain_loss, {}),
        # batch structures
        ("list-batch", "batch", plain_mlp, hi6.list_batch, plain_loss, {}),
        ("dict-batch-str-int", "batch", plain_mlp, hi6.dict_extras_batch, hi6.dict_extras_loss, {}),
        ("nested-tuple-mask", "batch", hm6.MaskedEncoder, hi6.nested_batch, hi6.nested_loss, {}),
        ("varlen-pad-to-longest", "batch", hm6.MaskedEncoder, hi6.varlen_batch, hi6.varlen_loss, {}),
        ("packed-sequence-batch", "batch", hm6.PackedLSTM, hi6.packed_batch, plain_loss, {}),
    ]


JOBS = [  # (case, suffix, settings): other jobs than AdamW at batch 4 in Lightning's order
    ("glm4-partial-rotary", "bf16mixed", {"precision": "bf16-mixed"}),
    ("cvt-conv-attn", "bf16mixed", {"precision": "bf16-mixed"}),
    ("teacher-student-kd-nograd", "bf16mixed", {"precision": "bf16-mixed"}),
    ("lora-frozen-base", "16mixed", {"precision": "16-mixed"}),
    ("xlm-roberta-xl-preln", "bf16true", {"precision": "bf16-true"}),
    ("smollm3-nope-layers", "ckpt", {"checkpointing": True}),
    ("zamba2-shared-blocks", "ckpt", {"checkpointing": True}),
    ("triplet-shared-encoder", "torch", {"loop": "torch"}),
    ("layoutlm-bbox", "adam-for-loop", {"optimizer": "adam-for-loop"}),
    ("multitask-two-heads", "sgd-dampening", {"optimizer": "sgd-dampening"}),
    ("list-batch", "lbfgs", {"optimizer": "lbfgs"}),
    ("where-gather-index-select", "adamw-maximize", {"optimizer": "adamw-maximize-wd"}),
    ("frozen-backbone-head", "adagrad-decay", {"optimizer": "adagrad-lr-decay"}),
]
