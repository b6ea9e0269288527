"""Reading a rank's meter: peaks per phase of a step, and the level at each of FSDP's own
transitions (all-gather, copy-out, reshard, pre/post-backward)."""

import functools


class SegmentMeter:
    """The meter's levels with peaks per segment: `mark` ends a segment (returning its peak) and
    starts the next; a phase's peak is the highest of its segments'."""

    def __init__(self, meter):
        self.m = meter
        self.high = 0

    def current(self):
        return self.m.current()

    def begin(self):
        self.m.reset_peak()
        self.high = self.m.current()

    def mark(self):
        p = self.m.peak()
        self.high = max(self.high, p)
        self.m.reset_peak()
        return p


def trace_transitions(groups, meter, events):
    """Records the meter at FSDP's own transitions of each unit's parameter group: after an
    all-gather (`unshard`, also when issued as a prefetch), after the copy-out into the
    unsharded parameters (`wait_for_unshard`), after a reshard, around `post_backward` (which
    frees the unsharded parameters and reduce-scatters the gradients). Each event carries the
    current level and the peak since the previous event. Python wrappers on the group object:
    nothing is allocated by them."""
    for name, module in groups:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            wrap = functools.partial(_wrap, group, name, meter, events)
            wrap("unshard", after="all_gather")
            wrap("wait_for_unshard", after="copy_out")
            wrap("post_forward", before="forward_compute_end", after="post_forward")
            wrap("pre_backward", after="pre_backward")
            wrap("post_backward", before="backward_compute_end", after="post_backward")


def _wrap(group, label, meter, events, method, before=None, after=None):
    """Replaces `group.method` by one that appends the `before` event before it and the `after`
    event after it, when it made a real transition."""
    orig = getattr(group, method)

    @functools.wraps(orig)
    def traced(*args, **kwargs):
        if before:
            events.append([before, label, meter.current(), meter.mark()])
        # A bool, not the result itself: holding it would keep the all-gather buffer
        # alive past the point where FSDP frees it.
        pending = group._all_gather_result is not None
        out = orig(*args, **kwargs)
        # unshard and wait_for_unshard are no-ops on a group already unsharded (the
        # root in backward) or already prefetched: only real transitions are events.
        did = {"unshard": not pending and group._all_gather_result is not None,
               "wait_for_unshard": pending}.get(method, True)
        if after and did:
            events.append([after, label, meter.current(), meter.mark()])
        return out

    setattr(group, method, traced)
