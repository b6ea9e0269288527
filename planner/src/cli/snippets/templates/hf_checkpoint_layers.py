def checkpoint_plan(model):
    """Transformers' per-layer checkpointing on exactly the plan's layers; returns their names."""
    backbone = ckptune.plan_root(model, PLAN)
    planned = PLAN["checkpoint"]["modules"]
    layers = {name: m for name, m in backbone.named_modules() if isinstance(m, GradientCheckpointingLayer)}
    missing = [name for name in planned if name not in layers]
    if missing:
        raise ValueError(f"not transformers checkpointing layers of this model: {missing}; its layers are "
                         f"{list(layers)[:4]}...; use ckptune.apply(model, PLAN)")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for name, layer in layers.items():
        layer.gradient_checkpointing = name in planned
    return [name for name in layers if name in planned]
