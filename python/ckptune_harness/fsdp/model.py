"""The model an FSDP run trains: a reference by name (models/fixtures/reference.py, its config
fields overridden) or the caller's callable, carried to the ranks in the spec; its FSDP units
and the modules it checkpoints. The parent builds a reference too, on the meta device, to refuse
before any process starts what the ranks would refuse."""

import base64
import dataclasses
import pickle
import re
import sys
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from ckptune import apply

from .. import reference
from ..plans import regex_plan

# The layers each reference family shards as FSDP units, by the backbone's module names (the
# names plans use). Everything else (embeddings, stem, head) lands in the root's group.
FAMILY_UNITS = {
    "ResNet": r"layer\d+",
    "BertForSequenceClassification": r"encoder\.layer\.\d+",
    "GPT2LMHeadModel": r"h\.\d+",
    "LlamaForCausalLM": r"model\.layers\.\d+",
}


class Built(NamedTuple):
    """A rank's model: the backbone plans name modules of (under `prefix`, the task wrapper's
    attribute path with its dot), its batches, and its family's units regex (None: no default)."""

    model: nn.Module
    backbone: nn.Module
    prefix: str
    make_batch: Callable[[], Any]
    loss_of: Callable[[Any], torch.Tensor]
    family_units: Optional[str]


class Loss(nn.Module):
    """The FSDP root: its forward is the micro-batch's loss, so the root's pre-forward hook (the
    all-gather of the embeddings, stem and head) runs once per forward whatever the task's call
    structure is (BERT's loss calls `model.bert` and `model.classifier`, never `model`)."""

    def __init__(self, model, loss_of):
        super().__init__()
        self.model = model
        self._loss_of = loss_of

    def forward(self, batch):
        return self._loss_of(batch)


def with_model(spec, model):
    """`spec` with what to train: a reference name, checked here as the ranks would check it, or
    a callable, pickled. Raises ValueError for anything else, or a callable that does not pickle."""
    if isinstance(model, str):
        ref = reference.load(spec.root)
        if model not in ref.NAMES:
            raise ValueError(f"model {model!r} has no plain-torch reference (models/fixtures/reference.py has "
                             f"{', '.join(ref.NAMES)})")
        spec = dataclasses.replace(spec, model=model)
        _check_reference(spec, ref)
        return spec
    if callable(model):
        if spec.config:
            raise ValueError("config overrides apply to a reference name, not to a callable")
        try:
            payload = pickle.dumps(model)
        except Exception as e:  # noqa: BLE001  (pickle raises several kinds)
            raise ValueError(f"the model callable must be picklable (a module-level function or a partial "
                             f"of one) to reach the rank processes: {e}") from None
        main = sys.modules.get("__main__")
        return dataclasses.replace(spec, model=None, builder=base64.b64encode(payload).decode(),
                                   main_path=getattr(main, "__file__", None) if b"__main__" in payload else None)
    raise ValueError(f"model must be a reference name or a callable, found {type(model).__name__}")


def _check_reference(spec, ref):
    """Refuses, before any process starts, what the ranks would refuse: unknown config fields, a
    shard or checkpoint regex that matches nothing, nested matches. The model is built on the
    meta device (no memory) with the ranks' code."""
    with torch.device("meta"):
        model, backbone, _ = reference_model(spec, ref)
    find_units(backbone, units_regex(spec, FAMILY_UNITS.get(type(model).__name__)))
    if spec.regex:
        checkpoint_modules(backbone, spec.regex)


def build_model(spec, ref, gen):
    """The model this rank trains, its parameters from the seed set before, its batches drawn
    from `gen`."""
    if spec.model is None:
        model, make_batch, loss_of = _from_callable(spec, gen)
        return Built(model, model, "", make_batch, loss_of, None)
    model, backbone, prefix = reference_model(spec, ref)
    make_batch, loss_of = reference.batches(ref, model, backbone, spec.micro_batch, spec.image, spec.seq, gen)
    return Built(model, backbone, prefix, make_batch, loss_of, FAMILY_UNITS.get(type(model).__name__))


def _from_callable(spec, gen):
    if spec.main_path:  # the callable lives in the parent's script: load it as multiprocessing does
        import runpy  # noqa: PLC0415
        import types  # noqa: PLC0415

        module = types.ModuleType("__mp_main__")
        module.__dict__.update(runpy.run_path(spec.main_path, run_name="__mp_main__"))
        sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    builder = pickle.loads(base64.b64decode(spec.builder))
    built = builder(spec.micro_batch, gen)
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module)):
        raise ValueError("the model callable must return (module, make_batch, loss_of)")
    return built


def reference_model(spec, ref):
    """(model, backbone, backbone prefix) of the reference name with the config overrides."""
    if spec.config:
        with torch.device("meta"):
            proto, prefix = ref.build(spec.model)
        model = _rebuild(ref, proto, prefix, spec.config)
    else:
        model, prefix = ref.build(spec.model)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    return model, backbone, prefix


def _rebuild(ref, proto, prefix, overrides):
    if isinstance(proto, ref.ResNet):
        return _rebuild_resnet(ref, proto, overrides)
    cfg = reference.config_of(proto, proto.get_submodule(prefix[:-1]) if prefix else proto)
    fields = dict(vars(cfg))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown {type(cfg).__name__} field {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    if isinstance(cfg, ref.LlamaConfig) and {"hidden_size", "num_attention_heads"} & set(overrides):
        fields.setdefault("head_dim", None)
        if "head_dim" not in overrides:
            fields["head_dim"] = None  # derived again from the new sizes
    fields.update(overrides)
    return type(proto)(type(cfg)(**fields))


def _rebuild_resnet(ref, proto, overrides):
    fields = {"layers": [len(getattr(proto, f"layer{i}")) for i in range(1, 5)],
              "inplanes": proto.conv1.out_channels, "num_classes": proto.fc.out_features,
              "block": "bottleneck" if isinstance(proto.layer1[0], ref.Bottleneck) else "basic"}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown ResNet config {', '.join(unknown)}; known: {', '.join(fields)}")
    fields.update(overrides)
    if fields["block"] not in ("basic", "bottleneck"):
        raise ValueError(f"ResNet block {fields['block']!r}: expected basic or bottleneck")
    block = ref.Bottleneck if fields["block"] == "bottleneck" else ref.BasicBlock
    return ref.ResNet(block, list(fields["layers"]), num_classes=int(fields["num_classes"]),
                      inplanes=int(fields["inplanes"]))


def units_regex(spec, family_units):
    """The units regex the run uses: the spec's, else the family's."""
    return spec.shard_regex if spec.shard_regex is not None else family_units


def find_units(backbone, shard_regex):
    """The FSDP units: the backbone's modules `shard_regex` fully matches, none inside another
    (`fully_shard` would nest them; the model here is one level of units under the root)."""
    found = _matches(backbone, shard_regex)
    if shard_regex and not found:
        raise ValueError(f"shard regex {shard_regex} matches no module of this model")
    names = [name for name, _ in found]
    nested = [f"{a} inside {b}" for a in names for b in names if a.startswith(b + ".")]
    if nested:
        raise ValueError(f"shard regex {shard_regex} matches nested modules ({'; '.join(nested)})")
    return found


def checkpoint_modules(backbone, regex):
    """Checkpoints the backbone's modules `regex` fully matches, as `ckptune.apply` does."""
    names = [name for name, _ in _matches(backbone, regex)]
    if not names:
        raise ValueError(f"checkpoint regex {regex} matches no module of this model")
    return apply(backbone, regex_plan(regex, names))


def _matches(module, pattern):
    if not pattern:
        return []
    rx = re.compile(pattern)
    return [(name, m) for name, m in module.named_modules() if name and rx.fullmatch(name)]
