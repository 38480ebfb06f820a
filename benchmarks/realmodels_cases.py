"""benchmarks.realmodels' cases: each architecture at a small size, with its batch, loss and setting, and the
subset also run in plain PyTorch order (`-torch`)."""
from __future__ import annotations

import functools

from benchmarks.realmodels_models import (
    VOCAB,
    MlpMixer,
    RNNClassifier,
    TopKMoE,
    TransformerClassifier,
    _hf,
    clip_batch,
    cls_batch,
    detr_batch,
    electra_batch,
    hf_loss,
    image_batch,
    image_tuple,
    lm_batch,
    mixer_loss,
    plain_batch,
    plain_cnn,
    plain_loss,
    plain_mlp,
    seq2seq_batch,
    speech_ctc_batch,
    token_batch,
    whisper_batch,
)
from benchmarks.zoo import Case

_DEC = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, use_cache=False)
_ENC = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, num_labels=4)
_MOE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, use_cache=False, num_experts_per_tok=2)
_MOE_PEAK = dict(_MOE, vocab_size=64, max_position_embeddings=512)
"""A vocabulary small enough that the logits are not the peak."""
_VIT = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, num_labels=10)


def _moe_peak_batch(batch_size: int) -> dict:
    return lm_batch(batch_size, seq_len=256, vocab=64)


TORCH_ORDER = ("gpt2", "llama-gqa", "bert", "t5", "vit", "resnet-hf", "convnext", "plain-lstm", "mixtral-eager",
               "mixtral-grouped_mm", "mixtral-experts-peak-grouped_mm", "plain-topk-moe")
"""Cases also run in plain PyTorch order (`-torch`)."""


def _hf_case(model_class, config_class, attn="sdpa", batch=lm_batch, **config):
    """(build, make_batch, loss) of a transformers model whose output has `.loss`."""
    return functools.partial(_hf, model_class, config_class, attn, **config), batch, hf_loss


def _cases() -> list[tuple]:
    """(name, family, build, make_batch, loss, settings)."""
    d = _DEC
    cases = [
        # decoder LMs
        ("gpt2", "decoder", *_hf_case("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=128, n_layer=2,
                                      n_head=4, n_positions=256, use_cache=False), {}),
        ("llama-gqa", "decoder", *_hf_case("LlamaForCausalLM", "LlamaConfig", **d, num_key_value_heads=2), {}),
        ("llama-gqa-bf16mixed-ckpt", "decoder",
         *_hf_case("LlamaForCausalLM", "LlamaConfig", **d, num_key_value_heads=2),
         {"precision": "bf16-mixed", "checkpointing": True}),
        ("mistral-sliding-window", "decoder",
         *_hf_case("MistralForCausalLM", "MistralConfig", **d, num_key_value_heads=2, sliding_window=16), {}),
        ("qwen2", "decoder", *_hf_case("Qwen2ForCausalLM", "Qwen2Config", **d, num_key_value_heads=2), {}),
        ("qwen3", "decoder", *_hf_case("Qwen3ForCausalLM", "Qwen3Config", **d, num_key_value_heads=2, head_dim=32), {}),
        ("gemma-mqa", "decoder", *_hf_case("GemmaForCausalLM", "GemmaConfig", **d, num_key_value_heads=1, head_dim=32),
         {}),
        ("gemma2-sliding-softcap", "decoder", *_hf_case("Gemma2ForCausalLM", "Gemma2Config", "eager", **d,
                                                         num_key_value_heads=2, head_dim=32, sliding_window=16), {}),
        ("phi", "decoder", *_hf_case("PhiForCausalLM", "PhiConfig", **d), {}),
        ("phi3", "decoder", *_hf_case("Phi3ForCausalLM", "Phi3Config", **d, num_key_value_heads=2, pad_token_id=0), {}),
        ("falcon-mqa", "decoder", *_hf_case("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                                            use_cache=False), {}),
        ("falcon-alibi", "decoder", *_hf_case("FalconForCausalLM", "FalconConfig", "eager", vocab_size=VOCAB,
                                              hidden_size=128, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                                              use_cache=False), {}),
        ("bloom-alibi", "decoder", *_hf_case("BloomForCausalLM", "BloomConfig", "eager", vocab_size=VOCAB,
                                             hidden_size=128, n_layer=2, n_head=4, use_cache=False), {}),
        ("mpt-alibi", "decoder", *_hf_case("MptForCausalLM", "MptConfig", "eager", vocab_size=VOCAB, d_model=128,
                                           n_layers=2, n_heads=4, max_seq_len=256, use_cache=False), {}),
        ("gpt-neox", "decoder", *_hf_case("GPTNeoXForCausalLM", "GPTNeoXConfig", **d), {}),
        ("gptj", "decoder", *_hf_case("GPTJForCausalLM", "GPTJConfig", "eager", vocab_size=VOCAB, n_embd=128, n_layer=2,
                                      n_head=4, rotary_dim=16, n_positions=256, use_cache=False), {}),
        ("opt", "decoder", *_hf_case("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=128, ffn_dim=256,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                     word_embed_proj_dim=128, use_cache=False), {}),
        ("stablelm", "decoder", *_hf_case("StableLmForCausalLM", "StableLmConfig", **d, num_key_value_heads=2), {}),
        ("starcoder2", "decoder", *_hf_case("Starcoder2ForCausalLM", "Starcoder2Config", **d, num_key_value_heads=2),
         {}),
        ("olmo", "decoder", *_hf_case("OlmoForCausalLM", "OlmoConfig", **d), {}),
        ("cohere", "decoder", *_hf_case("CohereForCausalLM", "CohereConfig", **d, num_key_value_heads=2), {}),
        ("codegen", "decoder", *_hf_case("CodeGenForCausalLM", "CodeGenConfig", "eager", vocab_size=VOCAB, n_embd=128,
                                         n_layer=2, n_head=4, rotary_dim=16, n_positions=256, n_ctx=256,
                                         use_cache=False), {}),
        ("gpt-bigcode-mqa", "decoder", *_hf_case("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB,
                                                 n_embd=128, n_layer=2, n_head=4, n_positions=256, multi_query=True,
                                                 use_cache=False), {}),
        ("granite", "decoder", *_hf_case("GraniteForCausalLM", "GraniteConfig", **d, num_key_value_heads=2), {}),
        ("mamba", "state-space", *_hf_case("MambaForCausalLM", "MambaConfig", None, vocab_size=VOCAB, hidden_size=128,
                                           state_size=8, num_hidden_layers=2, use_cache=False), {}),
        ("mamba2", "state-space",
         *_hf_case("Mamba2ForCausalLM", "Mamba2Config", None, vocab_size=VOCAB, hidden_size=128,
                   state_size=16, num_heads=8, head_dim=32, n_groups=1, num_hidden_layers=2,
                   chunk_size=32, use_cache=False), {}),
    ]
    # mixture of experts, both experts paths
    for impl in ("eager", "grouped_mm"):
        cases += [
            (f"mixtral-{impl}", "moe", *_hf_case("MixtralForCausalLM", "MixtralConfig", **_MOE, num_local_experts=4,
                                                 experts_implementation=impl), {}),
            (f"qwen2-moe-{impl}", "moe", *_hf_case("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_MOE, num_experts=4,
                                                   moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                                   experts_implementation=impl), {}),
            (f"olmoe-{impl}", "moe", *_hf_case("OlmoeForCausalLM", "OlmoeConfig", **_MOE, num_experts=8,
                                               experts_implementation=impl), {}),
            (f"qwen3-moe-{impl}", "moe", *_hf_case("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_MOE, num_experts=8,
                                                   moe_intermediate_size=128, head_dim=32,
                                                   experts_implementation=impl), {}),
        ]
    cases += [
        ("mixtral-grouped_mm-bf16mixed-ckpt", "moe", *_hf_case("MixtralForCausalLM", "MixtralConfig", **_MOE,
                                                               num_local_experts=4,
                                                               experts_implementation="grouped_mm"),
         {"precision": "bf16-mixed", "checkpointing": True}),
        ("plain-topk-moe", "moe", TopKMoE, token_batch, plain_loss, {}),
    ]
    for impl in ("eager", "grouped_mm"):  # the experts, not the logits, at the peak: routing decides it
        cases += [
            (f"mixtral-experts-peak-{impl}", "moe", *_hf_case(
                "MixtralForCausalLM", "MixtralConfig", **{**_MOE_PEAK, "intermediate_size": 512}, num_local_experts=8,
                experts_implementation=impl, batch=_moe_peak_batch), {}),
            (f"qwen3-moe-experts-peak-{impl}", "moe", *_hf_case(
                "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_MOE_PEAK, num_experts=16, moe_intermediate_size=256,
                head_dim=32, experts_implementation=impl, batch=_moe_peak_batch), {}),
            (f"mixtral-experts-peak-{impl}-ckpt", "moe", *_hf_case(
                "MixtralForCausalLM", "MixtralConfig", **{**_MOE_PEAK, "intermediate_size": 2048}, num_local_experts=8,
                experts_implementation=impl, batch=_moe_peak_batch), {"checkpointing": True}),
        ]
    cases += [
        # encoders
        ("bert", "encoder", *_hf_case("BertForSequenceClassification", "BertConfig", batch=cls_batch, **_ENC), {}),
        ("roberta", "encoder", *_hf_case("RobertaForSequenceClassification", "RobertaConfig", batch=cls_batch,
                                         **{**_ENC, "pad_token_id": 0}), {}),
        ("distilbert", "encoder", *_hf_case("DistilBertForSequenceClassification", "DistilBertConfig", batch=cls_batch,
                                            vocab_size=VOCAB, dim=128, hidden_dim=256, n_layers=2, n_heads=4,
                                            num_labels=4), {}),
        ("albert", "encoder", *_hf_case("AlbertForSequenceClassification", "AlbertConfig", batch=cls_batch, **_ENC,
                                        embedding_size=64), {}),
        ("electra-rtd-masked-loss", "encoder", *_hf_case("ElectraForPreTraining", "ElectraConfig", batch=electra_batch,
                                                         **_ENC, embedding_size=64), {}),
        ("deberta-v2", "encoder", *_hf_case("DebertaV2ForSequenceClassification", "DebertaV2Config", None,
                                            batch=cls_batch, **_ENC), {}),
        ("mpnet", "encoder", *_hf_case("MPNetForSequenceClassification", "MPNetConfig", None, batch=cls_batch,
                                       **_ENC), {}),
        # encoder-decoders
        ("t5", "encoder-decoder", *_hf_case("T5ForConditionalGeneration", "T5Config", batch=seq2seq_batch,
                                            vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2,
                                            num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                            use_cache=False), {}),
        ("bart", "encoder-decoder", *_hf_case("BartForConditionalGeneration", "BartConfig", batch=seq2seq_batch,
                                              vocab_size=VOCAB, d_model=128, encoder_layers=2, decoder_layers=2,
                                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                              decoder_ffn_dim=256, max_position_embeddings=256, use_cache=False), {}),
        ("pegasus", "encoder-decoder", *_hf_case("PegasusForConditionalGeneration", "PegasusConfig",
                                                 batch=seq2seq_batch, vocab_size=VOCAB, d_model=128, encoder_layers=2,
                                                 decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                                 encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=256,
                                                 use_cache=False), {}),
        ("marian", "encoder-decoder", *_hf_case("MarianMTModel", "MarianConfig", batch=seq2seq_batch, vocab_size=VOCAB,
                                                d_model=128, encoder_layers=2, decoder_layers=2,
                                                encoder_attention_heads=4,
                                                decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                                                max_position_embeddings=256, decoder_start_token_id=0, pad_token_id=0,
                                                use_cache=False), {}),
        ("switch-transformers-moe", "moe", *_hf_case("SwitchTransformersForConditionalGeneration",
                                                     "SwitchTransformersConfig", None, batch=seq2seq_batch,
                                                     vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2,
                                                     num_decoder_layers=2, num_heads=4, num_experts=4,
                                                     encoder_sparse_step=1, decoder_sparse_step=1,
                                                     decoder_start_token_id=0, pad_token_id=0, use_cache=False), {}),
        # speech
        ("wav2vec2-ctc", "speech", *_hf_case("Wav2Vec2ForCTC", "Wav2Vec2Config", None, batch=speech_ctc_batch,
                                             vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=256, conv_dim=(64, 64, 64), conv_stride=(5, 2, 2),
                                             conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                             num_conv_pos_embedding_groups=4, ctc_loss_reduction="mean", pad_token_id=0,
                                             mask_time_prob=0.0, layerdrop=0.0), {}),
        ("hubert-ctc", "speech", *_hf_case("HubertForCTC", "HubertConfig", None, batch=speech_ctc_batch, vocab_size=32,
                                           hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=256, conv_dim=(64, 64, 64), conv_stride=(5, 2, 2),
                                           conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                           num_conv_pos_embedding_groups=4, ctc_loss_reduction="mean", pad_token_id=0,
                                           mask_time_prob=0.0, layerdrop=0.0), {}),
        ("whisper", "speech", *_hf_case("WhisperForConditionalGeneration", "WhisperConfig", batch=whisper_batch,
                                        vocab_size=VOCAB, num_mel_bins=16, d_model=128, encoder_layers=2,
                                        decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                        decoder_ffn_dim=256, max_source_positions=100, max_target_positions=64,
                                        decoder_start_token_id=1, pad_token_id=0, use_cache=False), {}),
        # vision
        ("vit", "vision", *_hf_case("ViTForImageClassification", "ViTConfig", batch=image_batch, **_VIT), {}),
        ("deit", "vision", *_hf_case("DeiTForImageClassification", "DeiTConfig", batch=image_batch, **_VIT), {}),
        ("dinov2", "vision", *_hf_case("Dinov2ForImageClassification", "Dinov2Config", batch=image_batch,
                                       **{**_VIT, "mlp_ratio": 2}), {}),
        ("swin", "vision", *_hf_case("SwinForImageClassification", "SwinConfig", None, batch=image_batch, image_size=32,
                                     patch_size=2, embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4,
                                     num_labels=10), {}),
        ("convnext", "cnn", *_hf_case("ConvNextForImageClassification", "ConvNextConfig", None, batch=image_batch,
                                      hidden_sizes=[32, 64], depths=[1, 1], num_stages=2, num_labels=10), {}),
        ("resnet-hf", "cnn", *_hf_case("ResNetForImageClassification", "ResNetConfig", None, batch=image_batch,
                                       embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10), {}),
        ("clip", "vision", functools.partial(
            _hf, "CLIPModel", "CLIPConfig", "sdpa",
            text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=32),
            vision_config=dict(image_size=32, patch_size=4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4),
            projection_dim=32), clip_batch, hf_loss, {}),
        ("detr-hungarian", "detection", functools.partial(
            _hf, "DetrForObjectDetection", "DetrConfig", None, use_timm_backbone=False, use_pretrained_backbone=False,
            backbone_config={"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 32, 64],
                             "depths": [1, 1, 1, 1], "out_features": ["stage4"]},
            d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_queries=10, num_labels=5, auxiliary_loss=False),
         detr_batch, hf_loss, {}),
        # plain torch
        ("plain-mlp", "plain torch", plain_mlp, plain_batch, plain_loss, {}),
        ("plain-cnn-batchnorm", "plain torch", plain_cnn, image_tuple, plain_loss, {}),
        ("plain-lstm", "plain torch", functools.partial(RNNClassifier, "lstm"), token_batch, plain_loss, {}),
        ("plain-gru", "plain torch", functools.partial(RNNClassifier, "gru"), token_batch, plain_loss, {}),
        ("plain-transformer-encoder", "plain torch", TransformerClassifier, token_batch, plain_loss, {}),
        ("plain-mlp-mixer", "plain torch", MlpMixer, image_batch, mixer_loss, {}),
    ]
    by_name = {c[0]: c for c in cases}
    cases += [(f"{name}-torch", *by_name[name][1:5], {**by_name[name][5], "loop": "torch"}) for name in TORCH_ORDER]
    return cases


def _make_cases() -> dict[str, Case]:
    out = {}
    for name, family, build, make_batch, loss, settings in _cases():
        settings = {"batch_size": 4, **settings}
        out[name] = Case(name=name, family=family, build=build, make_batch=make_batch, loss=loss, **settings)
    return out


CASES: dict[str, Case] = _make_cases()
