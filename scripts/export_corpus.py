"""Exports the corpus of real architectures that `scripts/export_corpus` runs ckptune on: every
torchvision classification model and a broad set of Hugging Face transformers architectures, each
built with a small configuration on the CPU, random weights, in training mode, and exported the
way the README tells users to (`torch.export.export(model.train(), ..., dynamic_shapes=<batch>,
strict=False)`, then `torch.export.save`). Writes OUT_DIR/NAME.pt2 per model and
OUT_DIR/manifest.json: per model its source, kind, class, input, parameter count and export
status (the exception's first line when the export failed).

Run with the project's venv and the corpus packages (scripts/corpus-requirements.txt) on the path:

    PYTHONPATH=<corpus packages> .venv/bin/python scripts/export_corpus.py OUT_DIR [--only NAME...]

torchvision models keep their builder's configuration (num_classes=10) and the image size they
train at (224 px; 299 for inception_v3, 256 for swin_v2); the five whose default configuration has
more than 150M parameters are built by the same torchvision builder at a quarter of the width, same
depth, and say so in their record (REDUCED). transformers models take tiny configurations
(hidden 32-64, 4 layers, vocabulary 128, 128 tokens) and their inputs as a user passes them: `input_ids`
then `attention_mask` as keyword arguments (`use_cache=False` for decoders), `pixel_values`, or
audio.

Input sizes are chosen so that a batch of 2's activations outweigh the parameters: below that, the
step's peak is where the gradients and the optimizer state meet, checkpointing cannot lower it,
and no budget makes a plan checkpoint anything (torchvision's resnet18 at 32 px peaks at 188.68 MiB
with nothing and with everything checkpointed; at 224 px, 208.61 and 205.04 MiB).
"""

import argparse
import collections
import dataclasses
import json
import os
import signal
import sys
import time
from typing import Callable

import torch
from torch.export import Dim

BATCH = 2
SEQ = 128
POSITIONS = 2 * SEQ
VOCAB = 128
CLASSES = 10
EXPORT_TIMEOUT_S = 600
# The torchvision models whose default configuration has more than 150M parameters (at 10
# classes): their training step would need 5-11 GB (16 bytes per parameter with AdamW, plus the
# loaded program) on a machine shared with others, so they are built at a quarter width.
REDUCED = {"vit_l_16": 303_311_882, "vit_l_32": 305_520_650, "vit_h_14": 630_777_610,
           "convnext_large": 196_245_706, "regnet_y_128gf": 637_493_824}


@dataclasses.dataclass
class Entry:
    """One corpus model: how to build it and the inputs it is exported with."""

    name: str
    source: str  # "torchvision" or "transformers"
    kind: str  # family and kind, e.g. "CNN", "encoder-only", "decoder-only (GQA)"
    make: Callable[[], tuple]  # () -> (model, Inputs)
    note: str = ""


@dataclasses.dataclass
class Inputs:
    """What the model is exported with: positional args, keyword args (in the order given, which
    is the program's input order) and the matching dynamic shapes."""

    kind: str  # image, tokens, tokens+mask, audio, audio features
    args: tuple
    kwargs: dict
    dynamic_shapes: object


# ---- inputs -----------------------------------------------------------------------------------


def _gen():
    return torch.Generator().manual_seed(1)


def image_inputs(size, channels=3, keyword=None):
    x = torch.randn(BATCH, channels, size, size, generator=_gen())
    if keyword:
        return Inputs("image", (), {keyword: x}, {keyword: {0: Dim("batch")}})
    return Inputs("image", (x,), {}, ({0: Dim("batch")},))


def token_inputs(mask=True, use_cache=None, low=3):
    """Token ids (from `low`, above the pad, bos and eos ids of every config here) and, when
    `mask`, their attention mask with padding at the end of the second sequence, as a tokenizer
    makes it."""
    batch = Dim("batch")
    kwargs = collections.OrderedDict(input_ids=torch.randint(low, VOCAB, (BATCH, SEQ), generator=_gen()))
    shapes = {"input_ids": {0: batch}}
    if mask:
        m = torch.ones(BATCH, SEQ, dtype=torch.long)
        m[1, 3 * SEQ // 4:] = 0
        kwargs["attention_mask"] = m
        shapes["attention_mask"] = {0: batch}
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
        shapes["use_cache"] = None
    return Inputs("tokens+mask" if mask else "tokens", (), dict(kwargs), shapes)


def audio_inputs(samples, keyword="input_values"):
    x = torch.randn(BATCH, samples, generator=_gen())
    return Inputs("audio", (), {keyword: x}, {keyword: {0: Dim("batch")}})


def feature_inputs(shape, keyword):
    x = torch.randn(BATCH, *shape, generator=_gen())
    return Inputs("audio features", (), {keyword: x}, {keyword: {0: Dim("batch")}})


# ---- torchvision --------------------------------------------------------------------------------


def _reduced_builders():
    """The REDUCED architectures, each by torchvision's own builder at a quarter of the width,
    same depth and heads."""
    from torchvision.models import convnext, regnet, vision_transformer as vt

    def vit(patch, layers, heads, hidden, mlp):
        return lambda **kw: vt._vision_transformer(patch_size=patch, num_layers=layers, num_heads=heads,
                                                   hidden_dim=hidden // 4, mlp_dim=mlp // 4, weights=None,
                                                   progress=False, **kw)

    def convnext_large(**kw):
        c = convnext.CNBlockConfig
        setting = [c(48, 96, 3), c(96, 192, 3), c(192, 384, 27), c(384, None, 3)]
        return convnext._convnext(setting, 0.5, None, False, **kw)

    def regnet_y_128gf(**kw):
        # A quarter of w_0 and the group width, rounded to the multiples of 8 RegNet requires:
        # the same stage depths (2, 7, 17, 1).
        params = regnet.BlockParams.from_init_params(depth=27, w_0=112, w_a=160.83 / 4, w_m=2.52, group_width=64,
                                                     se_ratio=0.25)
        return regnet._regnet(params, None, False, **kw)

    return {
        "vit_l_16": vit(16, 24, 16, 1024, 4096),
        "vit_l_32": vit(32, 24, 16, 1024, 4096),
        "vit_h_14": vit(14, 32, 16, 1280, 5120),
        "convnext_large": convnext_large,
        "regnet_y_128gf": regnet_y_128gf,
    }


def _tv_kind(name):
    for prefix, kind in (("vit_", "vision transformer"), ("swin", "vision transformer (windows)"),
                         ("maxvit", "vision transformer (conv + windows)"), ("convnext", "CNN (ConvNeXt)")):
        if name.startswith(prefix):
            return kind
    return "CNN"


def _tv_image_size(name):
    """The image side each architecture trains at: ImageNet's 224, Inception's 299, Swin V2's 256
    (its window of 8 covers the last stage's map, as the window of 7 does at 224 for Swin)."""
    return {"inception_v3": 299}.get(name, 256 if name.startswith("swin_v2") else 224)


def _register_output_tuples():
    """GoogLeNet and Inception v3 return namedtuples in training mode (the logits and the
    auxiliary classifiers'), which torch.export.save cannot serialize until they are registered;
    the error message tells users to do this."""
    from torch.utils._pytree import _register_namedtuple
    from torchvision.models.googlenet import GoogLeNetOutputs
    from torchvision.models.inception import InceptionOutputs

    for cls in (GoogLeNetOutputs, InceptionOutputs):
        _register_namedtuple(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def torchvision_entries():
    import torchvision

    _register_output_tuples()
    reduced = _reduced_builders()

    def make(name):
        builder = reduced.get(name) or (lambda **kw: torchvision.models.get_model(name, **kw))
        return builder(num_classes=CLASSES), image_inputs(_tv_image_size(name))

    def note(name):
        return f"quarter width, same depth (the default has {REDUCED[name] / 1e6:.0f}M parameters)" \
            if name in REDUCED else ""

    return [Entry(name, "torchvision", _tv_kind(name), lambda name=name: make(name), note(name))
            for name in torchvision.models.list_models(module=torchvision.models)]


# ---- transformers --------------------------------------------------------------------------------

# Tiny shapes shared by the text models (each config class names them its own way).
BERTISH = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=POSITIONS, num_labels=CLASSES, pad_token_id=0)
LLAMAISH = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=POSITIONS, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, num_labels=CLASSES)
VIT = dict(image_size=64, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
           intermediate_size=64, num_labels=CLASSES)
WAV2VEC2 = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2), num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=2, num_labels=CLASSES, classifier_proj_size=16,
                # LayerDrop draws a random number per layer and branches on it, which torch.export
                # refuses (GuardOnDataDependentSymNode); SpecAugment's numpy mask would be frozen
                # into the program. A user exporting for training turns both off.
                layerdrop=0.0, mask_time_prob=0.0)


def _hf(cls, config_cls, config, inputs, part=None):
    """A maker of transformers' `cls` from `config_cls(**config)` and its inputs; `part` takes a
    submodule a user trains on its own (an encoder-decoder's `get_encoder()`)."""
    import transformers

    def make():
        model = getattr(transformers, cls)(getattr(transformers, config_cls)(**config))
        return (getattr(model, part)() if part else model), inputs()

    return make


def _text(name, kind, cls, config_cls, config, mask=True, use_cache=None, part=None, note=""):
    make = _hf(cls, config_cls, config, lambda: token_inputs(mask, use_cache), part)
    return Entry(name, "transformers", kind, make, note or _class_note(cls, part))


def _vision(name, kind, cls, config_cls, config, note=""):
    size = config.get("image_size", 32)
    make = _hf(cls, config_cls, config, lambda: image_inputs(size, keyword="pixel_values"))
    return Entry(name, "transformers", kind, make, note or _class_note(cls))


def _audio(name, kind, cls, config_cls, config, inputs, part=None):
    return Entry(name, "transformers", kind, _hf(cls, config_cls, config, inputs, part), _class_note(cls, part))


def _class_note(cls, part=None):
    return f"`{cls}`" + (f"`.{part}()`" if part else "")


def transformers_entries():
    dec = dict(use_cache=False)
    t5 = dict(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=4, num_heads=2, pad_token_id=0,
              decoder_start_token_id=0, relative_attention_num_buckets=8)
    bart = dict(vocab_size=VOCAB, d_model=32, encoder_layers=4, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=POSITIONS,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    gpt2 = dict(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=4, n_head=2, bos_token_id=1, eos_token_id=2)
    swin = dict(image_size=64, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                num_labels=CLASSES)
    whisper = dict(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   max_source_positions=64, max_target_positions=64, num_labels=CLASSES, classifier_proj_size=16,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return [
        # encoder-only
        _text("bert-seqcls", "encoder-only", "BertForSequenceClassification", "BertConfig", BERTISH),
        _text("bert-model", "encoder-only (base model: pooler output)", "BertModel", "BertConfig", BERTISH),
        _text("bert-mlm", "encoder-only (masked LM)", "BertForMaskedLM", "BertConfig", BERTISH),
        _text("roberta-seqcls", "encoder-only", "RobertaForSequenceClassification", "RobertaConfig",
              {**BERTISH, "pad_token_id": 1, "max_position_embeddings": POSITIONS + 2}),
        _text("roberta-model", "encoder-only (base model: pooler output)", "RobertaModel", "RobertaConfig",
              {**BERTISH, "pad_token_id": 1, "max_position_embeddings": POSITIONS + 2}),
        _text("xlm-roberta-seqcls", "encoder-only", "XLMRobertaForSequenceClassification", "XLMRobertaConfig",
              {**BERTISH, "pad_token_id": 1, "max_position_embeddings": POSITIONS + 2}),
        _text("distilbert-seqcls", "encoder-only", "DistilBertForSequenceClassification", "DistilBertConfig",
              dict(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=2, hidden_dim=64, max_position_embeddings=POSITIONS,
                   num_labels=CLASSES, pad_token_id=0)),
        _text("electra-seqcls", "encoder-only", "ElectraForSequenceClassification", "ElectraConfig",
              {**BERTISH, "embedding_size": 32}),
        _text("deberta-v2-seqcls", "encoder-only (relative attention)", "DebertaV2ForSequenceClassification",
              "DebertaV2Config", {**BERTISH, "relative_attention": True, "position_buckets": 8,
                                  "pos_att_type": ["p2c", "c2p"], "max_relative_positions": 16}),
        _text("mpnet-seqcls", "encoder-only (relative position bias)", "MPNetForSequenceClassification",
              "MPNetConfig", {**BERTISH, "pad_token_id": 1, "max_position_embeddings": POSITIONS + 2}),
        _text("albert-seqcls", "encoder-only (shared layers)", "AlbertForSequenceClassification", "AlbertConfig",
              {**BERTISH, "embedding_size": 16, "num_hidden_groups": 1, "inner_group_num": 1}),
        _text("modernbert-seqcls", "encoder-only (alternating local attention)",
              "ModernBertForSequenceClassification", "ModernBertConfig",
              {**BERTISH, "local_attention": 8, "global_attn_every_n_layers": 2, "pad_token_id": 0,
               "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2}),
        # decoder-only
        _text("gpt2-lm", "decoder-only", "GPT2LMHeadModel", "GPT2Config", gpt2, **dec),
        _text("gpt-neo-lm", "decoder-only (local attention layers)", "GPTNeoForCausalLM", "GPTNeoConfig",
              dict(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=2, max_position_embeddings=POSITIONS,
                   attention_types=[[["global", "local"], 2]], window_size=8, bos_token_id=1, eos_token_id=2), **dec),
        _text("gpt-neox-lm", "decoder-only (rotary, parallel residual)", "GPTNeoXForCausalLM", "GPTNeoXConfig",
              {**LLAMAISH, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}, **dec),
        _text("gptj-lm", "decoder-only (parallel attention/MLP)", "GPTJForCausalLM", "GPTJConfig",
              dict(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=4, n_head=2, rotary_dim=8,
                   bos_token_id=1, eos_token_id=2), **dec),
        _text("opt-lm", "decoder-only", "OPTForCausalLM", "OPTConfig",
              dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, ffn_dim=64,
                   max_position_embeddings=POSITIONS, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2), **dec),
        _text("bloom-lm", "decoder-only (ALiBi)", "BloomForCausalLM", "BloomConfig",
              dict(vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=2, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2), **dec),
        _text("falcon-lm", "decoder-only (multi-query)", "FalconForCausalLM", "FalconConfig",
              dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, multi_query=True,
                   bos_token_id=1, eos_token_id=2), **dec),
        _text("llama-lm", "decoder-only (GQA)", "LlamaForCausalLM", "LlamaConfig", LLAMAISH, **dec),
        _text("llama-model", "decoder-only (GQA, base model)", "LlamaModel", "LlamaConfig", LLAMAISH, **dec),
        _text("llama-lm-ids-only", "decoder-only (GQA, no mask input)", "LlamaForCausalLM", "LlamaConfig",
              LLAMAISH, mask=False, **dec),
        _text("llama-seqcls", "decoder-only (GQA, sequence classification)", "LlamaForSequenceClassification",
              "LlamaConfig", LLAMAISH, **dec),
        _text("mistral-lm", "decoder-only (GQA, sliding window)", "MistralForCausalLM", "MistralConfig",
              {**LLAMAISH, "sliding_window": 8}, **dec),
        _text("mixtral-lm", "decoder-only (GQA, sliding window, mixture of experts)", "MixtralForCausalLM",
              "MixtralConfig", {**LLAMAISH, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
              **dec),
        _text("mixtral-lm-batched-mm", "decoder-only (mixture of experts, experts_implementation=batched_mm)",
              "MixtralForCausalLM", "MixtralConfig",
              {**LLAMAISH, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
               "experts_implementation": "batched_mm"}, **dec,
              note="`MixtralForCausalLM` with the experts as batched matmuls instead of transformers' "
                   "`grouped_mm_fallback` custom op (`eager` experts do not export: data-dependent)"),
        _text("qwen2-lm", "decoder-only (GQA)", "Qwen2ForCausalLM", "Qwen2Config", LLAMAISH, **dec),
        _text("qwen3-lm", "decoder-only (GQA, q/k norm)", "Qwen3ForCausalLM", "Qwen3Config",
              {**LLAMAISH, "head_dim": 16}, **dec),
        _text("gemma-lm", "decoder-only (multi-query)", "GemmaForCausalLM", "GemmaConfig",
              {**LLAMAISH, "num_key_value_heads": 1, "head_dim": 16}, **dec),
        _text("gemma2-lm", "decoder-only (GQA, alternating sliding window, soft-capping)", "Gemma2ForCausalLM",
              "Gemma2Config", {**LLAMAISH, "head_dim": 16, "sliding_window": 8}, **dec),
        _text("phi-lm", "decoder-only (parallel attention/MLP, partial rotary)", "PhiForCausalLM", "PhiConfig",
              {**LLAMAISH, "num_key_value_heads": 4}, **dec),
        _text("phi3-lm", "decoder-only (GQA, fused qkv)", "Phi3ForCausalLM", "Phi3Config", LLAMAISH, **dec),
        # encoder-decoder models' encoders
        _text("t5-encoder", "encoder of encoder-decoder (relative position bias)", "T5EncoderModel", "T5Config", t5),
        _text("mt5-encoder", "encoder of encoder-decoder (relative position bias, gated)", "MT5EncoderModel",
              "MT5Config", {**t5, "feed_forward_proj": "gated-gelu"}),
        _text("bart-encoder", "encoder of encoder-decoder", "BartModel", "BartConfig", bart, part="get_encoder"),
        _text("mbart-encoder", "encoder of encoder-decoder (pre-norm)", "MBartModel", "MBartConfig", bart,
              part="get_encoder"),
        _text("pegasus-encoder", "encoder of encoder-decoder (sinusoidal positions)", "PegasusModel",
              "PegasusConfig", bart, part="get_encoder"),
        # vision encoders
        _vision("vit-imgcls", "vision transformer", "ViTForImageClassification", "ViTConfig", VIT),
        _vision("deit-imgcls", "vision transformer (distillation token)", "DeiTForImageClassification",
                "DeiTConfig", VIT),
        _vision("beit-imgcls", "vision transformer (relative position bias)", "BeitForImageClassification",
                "BeitConfig", {**VIT, "use_relative_position_bias": True, "use_mean_pooling": True}),
        _vision("dinov2-imgcls", "vision transformer (layer scale)", "Dinov2ForImageClassification", "Dinov2Config",
                {**VIT, "mlp_ratio": 2}),
        _vision("swin-imgcls", "vision transformer (windows)", "SwinForImageClassification", "SwinConfig", swin),
        _vision("convnext-imgcls", "CNN (ConvNeXt)", "ConvNextForImageClassification", "ConvNextConfig",
                dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=CLASSES, image_size=64)),
        _vision("resnet-imgcls", "CNN", "ResNetForImageClassification", "ResNetConfig",
                dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=CLASSES,
                     image_size=64)),
        _vision("clip-vision", "vision transformer (base model: pooled output)", "CLIPVisionModel",
                "CLIPVisionConfig", {k: v for k, v in VIT.items() if k != "num_labels"}),
        _vision("siglip-vision", "vision transformer (base model: attention-pooling head)", "SiglipVisionModel",
                "SiglipVisionConfig", {k: v for k, v in VIT.items() if k != "num_labels"}),
        # audio encoders
        _audio("wav2vec2-seqcls", "audio encoder (conv features + transformer)", "Wav2Vec2ForSequenceClassification",
               "Wav2Vec2Config", WAV2VEC2, lambda: audio_inputs(8000)),
        _audio("wav2vec2-model", "audio encoder (base model: two outputs)", "Wav2Vec2Model", "Wav2Vec2Config",
               WAV2VEC2, lambda: audio_inputs(8000)),
        _audio("hubert-seqcls", "audio encoder (conv features + transformer)", "HubertForSequenceClassification",
               "HubertConfig", WAV2VEC2, lambda: audio_inputs(8000)),
        _audio("whisper-audiocls", "audio encoder (log-mel features)", "WhisperForAudioClassification",
               "WhisperConfig", whisper, lambda: feature_inputs((16, 128), "input_features")),
        _audio("whisper-encoder", "audio encoder (log-mel features)", "WhisperModel", "WhisperConfig", whisper,
               lambda: feature_inputs((16, 128), "input_features"), part="get_encoder"),
    ]


# ---- export -------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _on_alarm(_signum, _frame):
    raise _Timeout(f"export took more than {EXPORT_TIMEOUT_S} s")


def first_line(e):
    text = f"{type(e).__name__}: {e}"
    return next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)


def export_one(entry, out_dir):
    """Builds, exports and saves one model; returns its manifest record."""
    record = {"name": entry.name, "source": entry.source, "kind": entry.kind, "note": entry.note}
    start = time.monotonic()
    signal.alarm(EXPORT_TIMEOUT_S)
    try:
        torch.manual_seed(0)
        model, inputs = entry.make()
        record["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
        record["params"] = sum(p.numel() for p in model.parameters())
        record["input"] = describe_inputs(inputs)
        ep = torch.export.export(model.train(), inputs.args, kwargs=inputs.kwargs,
                                 dynamic_shapes=inputs.dynamic_shapes, strict=False)
        path = os.path.join(out_dir, f"{entry.name}.pt2")
        tmp = os.path.join(out_dir, f"{entry.name}.tmp.pt2")  # torch.export.save wants the suffix
        torch.export.save(ep, tmp)
        os.replace(tmp, path)  # never a half-written program
        record.update(exported=True, file=f"{entry.name}.pt2", bytes=os.path.getsize(path))
    except Exception as e:  # noqa: BLE001 (every failure is a corpus result, recorded)
        record.update(exported=False, error=first_line(e))
    finally:
        signal.alarm(0)
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


def describe_inputs(inputs):
    tensors = [("arg0", inputs.args[0])] if inputs.args else []
    tensors += [(k, v) for k, v in inputs.kwargs.items() if isinstance(v, torch.Tensor)]
    constants = {k: v for k, v in inputs.kwargs.items() if not isinstance(v, torch.Tensor)}
    return {
        "kind": inputs.kind,
        "tensors": [{"name": k, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for k, t in tensors],
        "constants": constants,
    }


def write_manifest(out_dir, records):
    """Writes manifest.json, keeping the records of models not exported this time (--only)."""
    path = os.path.join(out_dir, "manifest.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = {r["name"]: r for r in json.load(f)["models"]}
    merged = {**old, **{r["name"]: r for r in records}}
    import torchvision
    import transformers
    manifest = {
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "transformers": transformers.__version__,
        "models": [merged[n] for n in sorted(merged, key=lambda n: (merged[n]["source"] != "torchvision", n))],
    }
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", help="where the programs and manifest.json go")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="export these models only")
    ap.add_argument("--list", action="store_true", help="print the corpus's model names and exit")
    a = ap.parse_args()
    torch.set_num_threads(1)
    entries = torchvision_entries() + transformers_entries()
    if a.list:
        print("\n".join(e.name for e in entries))
        return 0
    if not a.out_dir:
        ap.error("OUT_DIR is required")
    if a.only:
        unknown = set(a.only) - {e.name for e in entries}
        if unknown:
            sys.exit(f"export_corpus.py: unknown model(s) {', '.join(sorted(unknown))} (see --list)")
        entries = [e for e in entries if e.name in a.only]
    os.makedirs(a.out_dir, exist_ok=True)
    signal.signal(signal.SIGALRM, _on_alarm)
    records = []
    for i, entry in enumerate(entries, 1):
        record = export_one(entry, a.out_dir)
        status = "exported" if record["exported"] else f"FAILED: {record['error']}"
        print(f"[{i}/{len(entries)}] {entry.name} ({record.get('params', 0):,} params, {record['seconds']} s): "
              f"{status}", file=sys.stderr, flush=True)
        records.append(record)
        write_manifest(a.out_dir, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
