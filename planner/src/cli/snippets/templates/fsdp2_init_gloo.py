    """Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    with gloo, the plan's collective, on the CPU; returns this rank's device."""
    device = torch.device("cpu")
    dist.init_process_group(backend="gloo")
