//! `torch.cuda.memory_stats()` as the simulation keeps it: the `DeviceStats` of
//! c10/core/CachingDeviceAllocator.h, aggregated over both pools (the `.all.` keys), with the
//! same increases and decreases at the same places of the allocator as in PyTorch.

/// One statistic: its current value and its peak since the start or the last
/// [`reset_peak`](Stat::reset_peak) (`Stat::increase`, `Stat::decrease`, `Stat::reset_peak`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
}

impl Stat {
    pub(super) fn increase(&mut self, amount: u64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
    }

    pub(super) fn decrease(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "a statistic went negative");
        self.current -= amount;
    }

    pub(super) fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// The allocator's statistics, named as `memory_stats()` names them (`allocated_bytes` is
/// `allocated_bytes.all.*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Sum of the (rounded) sizes of the blocks handed out: `torch.cuda.memory_allocated()`.
    pub allocated_bytes: Stat,
    /// Sum of the segments held from the device (cudaMalloc'd, or mapped pages of expandable
    /// segments): `torch.cuda.memory_reserved()`.
    pub reserved_bytes: Stat,
    /// Bytes of active blocks: allocated ones (a block freed while used on another stream
    /// would stay active; the traces have no such uses, so this equals allocated).
    pub active_bytes: Stat,
    /// Bytes the callers asked for, before rounding.
    pub requested_bytes: Stat,
    /// Bytes of free blocks inside split, non-expandable segments: cached memory that
    /// `empty_cache()` cannot return.
    pub inactive_split_bytes: Stat,
    /// Live allocations.
    pub allocation: Stat,
    /// Active blocks.
    pub active: Stat,
    /// cudaMalloc'd segments. Expandable segments are not counted, as in PyTorch, whose
    /// `map_block` adds reserved bytes but no segment.
    pub segment: Stat,
    /// Free blocks inside split, non-expandable segments.
    pub inactive_split: Stat,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Final retries after `empty_cache()`-like releases (`num_alloc_retries`).
    pub num_alloc_retries: u64,
    /// Out-of-memory errors (`num_ooms`).
    pub num_ooms: u64,
    /// Requests rejected by `throw_on_cudamalloc_oom` (`num_oom_rejections`).
    pub num_oom_rejections: u64,
    /// cudaMalloc calls and expandable-segment mappings that succeeded (`num_device_alloc`).
    pub num_device_alloc: u64,
    /// cudaFree calls and unmappings (`num_device_free`).
    pub num_device_free: u64,
    /// The largest cached free block, as `cacheInfo` scans the pools (0 when there is none):
    /// the largest request that fits without reserving more. (`cacheInfo` itself starts from
    /// the device's free memory, for cuDNN's workspace sizing; that is left out here.)
    pub largest_free_block: u64,
}

impl Stats {
    /// `resetPeakStats`: every peak to its current value.
    pub(super) fn reset_peaks(&mut self) {
        for s in [
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.requested_bytes,
            &mut self.inactive_split_bytes,
            &mut self.allocation,
            &mut self.active,
            &mut self.segment,
            &mut self.inactive_split,
            &mut self.oversize_allocations,
            &mut self.oversize_segments,
        ] {
            s.reset_peak();
        }
    }
}
