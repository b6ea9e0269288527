

def apply_plan(config):
    """Sets the plan's activation checkpointing, batch and precision on a torchtitan Trainer.Config."""
    config.activation_checkpoint = ACTIVATION_CHECKPOINT
    for name, value in TRAINING.items():
        setattr(config.training, name, value)
    return config
