    for step, batch in enumerate(loader):
        # cache_enabled=False: autocast's cache would keep checkpointed layers' casts of their
        # weights until this region ends, which the plan does not count (results/pytorch-peaks).
        with torch.autocast(${device_type}, dtype=cfg.autocast_dtype, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=False):
            loss = ${loss} / cfg.grad_accum
        (scaler.scale(loss) if scaler else loss).backward()
        if (step + 1) % cfg.grad_accum == 0:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=cfg.set_to_none)
    return wrapped
