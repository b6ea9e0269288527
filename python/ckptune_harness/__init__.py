"""ckptune's measurement harness on the PyTorch side: runs that need a ckptune checkout, beside the
user package `ckptune`, which it uses and which never imports it.

- `meter`: ckptune's counting CPU allocator (kernels/csrc/shim.cpp) compiled and loaded into a
  PyTorch process.
- `reference`: the plain-torch references of models/fixtures/reference.py, and their batches.
- `eager`: a plan's model trained in PyTorch eager under the meter (`python -m
  ckptune_harness.eager`, the PyTorch side of `ckptune verify --pytorch`).
- `trainers`: the same through an emitted snippet in the Hugging Face Trainer or Lightning
  (`ckptune verify --pytorch --trainer`).
- `fsdp`: the same under FSDP2 on N CPU processes (`python -m ckptune_harness.fsdp`).
- `plans`, `output`, `lifetime`: a plan for a bare regex, JSON results, processes that die with
  their parent.

It finds the checkout beside this package (python/ckptune_harness/), or through
`$CKPTUNE_ROOT`. python/pyproject.toml does not ship it: `pip install ./python` installs
`ckptune` alone.
"""
