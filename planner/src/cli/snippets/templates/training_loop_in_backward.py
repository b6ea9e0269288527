    for batch in loader:
        # cache_enabled as planned: autocast's cache keeps the casts of weights (checkpointed
        # layers' too) until this region ends, which the plan counts only when it was made with
        # --autocast-cache (docs/memory-model.md, "Autocast's cache").
        with torch.autocast(${device_type}, dtype=cfg.autocast_dtype, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=cfg.autocast_cache):
            loss = ${loss}
        # Each parameter is stepped and its gradient freed during this backward: no opt.step(),
        # and no gradient accumulation or clipping, which would need every gradient first.
        loss.backward()
    return wrapped
