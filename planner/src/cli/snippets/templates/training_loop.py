    for step, batch in enumerate(loader):
        # cache_enabled as planned: autocast's cache keeps the casts of weights (checkpointed
        # layers' too) until this region ends, which the plan counts only when it was made with
        # --autocast-cache (docs/memory-model.md, "Autocast's cache").
        with torch.autocast(${device_type}, dtype=cfg.autocast_dtype, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=cfg.autocast_cache):
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
