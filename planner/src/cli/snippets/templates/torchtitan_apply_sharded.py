# ParallelismConfig fields (torchtitan.config.ParallelismConfig) for the plan's sharding: FSDP2 over
# ${ranks} ranks, reshard_after_forward=${reshard_after_forward} for every unit ("always"/"never"; torchtitan's "default"
# keeps norm and output gathered). torchtitan wraps tok_embeddings, every block layers.N, and norm
# with output as its units; the plan's units were ${plan_units}, its root the rest.
${mixed_precision_comment}PARALLELISM = {
    "data_parallel_shard_degree": ${ranks},
    "fsdp_reshard_after_forward": ${policy},
}


def apply_plan(config):
    """Sets the plan's activation checkpointing, batch, precision and sharding on a torchtitan
    Trainer.Config."""
    config.activation_checkpoint = ACTIVATION_CHECKPOINT
    for name, value in TRAINING.items():
        setattr(config.training, name, value)
    for name, value in PARALLELISM.items():
        setattr(config.parallelism, name, value)
    return config
