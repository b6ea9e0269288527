def checkpoint_plan(model):
    """ckptune.apply on the plan's modules; returns their names."""
    return ckptune.apply(model, PLAN)
