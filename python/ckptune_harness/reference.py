"""The plain-torch references of a ckptune checkout (models/fixtures/reference.py: torchvision
ResNet, Hugging Face BERT, GPT-2 and Llama with eager or SDPA attention, with the module names
ckptune uses),
and the batches ckptune's chain makes for them (`Chain::make_batch`: the same shapes and
dtypes). The eager and the FSDP runs both build their models and data here.
"""

import importlib.util
import os
import re

import torch
from torch import nn

from ckptune import chunked_causal_lm_loss

from . import meter


def load(root=None):
    """models/fixtures/reference.py of the checkout `root` (default: the meter's)."""
    path = os.path.join(root or meter.ROOT, "models", "fixtures", "reference.py")
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: the PyTorch run builds the plain-torch references of a "
                         f"ckptune checkout; set CKPTUNE_ROOT to one")
    spec = importlib.util.spec_from_file_location("ckptune_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_of(model, backbone):
    """A transformer's config: on the backbone (BERT's `bert`) or on the model (GPT-2's, whose
    `transformer` has none; Llama's, whose backbone is the model); None for a ResNet."""
    return getattr(backbone, "config", None) or getattr(model, "config", None)


def default_seq(model, backbone, seq=None):
    """A transformer's sequence length: `seq`, else min(128, its positions)."""
    cfg = config_of(model, backbone)
    return seq or min(128, getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None))


def batches(ref, model, backbone, batch, image, seq, gen, loss_chunks=1):
    """(make_batch, loss_of) for the reference `model`, as ckptune's chain makes batches:
    `make_batch()` draws a micro-batch of `batch` samples from `gen`, `loss_of(b)` is its loss
    (a language model's in `loss_chunks` chunks, `ckptune.chunked_causal_lm_loss`, above 1)."""
    if isinstance(model, ref.ResNet):
        return _image_batches(model, batch, image or 224, gen)
    return _token_batches(ref, model, backbone, batch, default_seq(model, backbone, seq), gen, loss_chunks)


def _image_batches(model, batch, image, gen):
    classes = model.fc.out_features

    def make_batch():
        x = torch.randn(batch, 3, image, image, generator=gen)
        return x, torch.randint(classes, (batch,), generator=gen), None

    def loss_of(b):
        x, y, _ = b
        return nn.functional.cross_entropy(model(x), y)

    return make_batch, loss_of


def _token_batches(ref, model, backbone, batch, seq, gen, loss_chunks=1):
    cfg = config_of(model, backbone)
    classifier = isinstance(model, ref.BertForSequenceClassification)

    def make_batch():
        ids = torch.randint(cfg.vocab_size, (batch, seq), generator=gen)
        if classifier:
            y = torch.randint(cfg.num_labels, (batch,), generator=gen)
        else:
            y = torch.randint(cfg.vocab_size, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        pad = seq // 4
        if pad > 0:
            mask[1::2, seq - pad:] = 0  # every other sequence: last quarter padded
        return ids, y, mask

    if classifier:
        def loss_of(b):
            ids, y, mask = b
            _, pooled = model.bert(ids, mask)
            logits = model.classifier(model.dropout(pooled))
            return nn.functional.cross_entropy(logits.view(-1, cfg.num_labels), y.view(-1))
    elif loss_chunks > 1:
        # The model's forward up to its last hidden states (GPT-2's `transformer`, Llama's
        # `model`), then the chunked head and loss in place of `lm_head` and `ForCausalLMLoss`.
        base = getattr(model, "transformer", None) or model.model

        def loss_of(b):
            ids, y, mask = b
            hidden = base(ids, mask)
            return chunked_causal_lm_loss(hidden, model.lm_head.weight, y, loss_chunks)
    else:
        # GPT-2's eager reference ignores the mask (it always has); its SDPA path uses it.
        def loss_of(b):
            ids, y, mask = b
            return model(ids, y, attention_mask=mask)[1]

    return make_batch, loss_of


def matching(model_name, regex, root=None):
    """The reference backbone's module names that fully match `regex` ('' matches none)."""
    if not regex:
        return []
    with torch.device("meta"):
        model, prefix = load(root).build(model_name)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    return [n for n, _ in backbone.named_modules() if n and re.fullmatch(regex, n)]
