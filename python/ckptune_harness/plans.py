"""A plan for a bare checkpoint regex: what the harness's runs give `ckptune.apply` and
`ckptune.training_config` when they are handed a regex and settings rather than a plan file
(the benchmark's checkpoint sets, the FSDP run's flags)."""


def regex_plan(regex, names, precision="fp32", optimizer="adamw", micro_batch=1, optimizer_impl="single"):
    """A plan dict for a bare checkpoint regex: `names` are the modules it matches, as
    `ckptune.apply` checks them."""
    return {"format": "ckptune.plan/1", "checkpoint": {"regex": regex or r"^[^\s\S]$", "modules": list(names)},
            "config": {"precision": precision, "optimizer": optimizer, "optimizer_impl": optimizer_impl,
                       "micro_batch": micro_batch, "grad_accum": 1, "set_to_none": True}}
