//! What a simulated `malloc` or `free` can fail with: PyTorch's out-of-memory error, with the
//! figures its message reports, and the mistakes of a trace (a free of an id not allocated).

/// Why the allocator gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OomKind {
    /// The device (or the `per_process_memory_fraction` limit) had no room even after
    /// releasing the cached blocks (`DeviceCachingAllocator::malloc`'s `TORCH_CHECK_WITH`).
    Device,
    /// `throw_on_cudamalloc_oom` rejected the request before trying the device
    /// (`NativeCachingAllocator::malloc`, "preemptively rejected").
    Rejected,
    /// A request of 1 EiB or more (`NativeCachingAllocator::allocate`).
    OverOneExabyte,
}

/// PyTorch's `torch.OutOfMemoryError`, with the numbers of its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemory {
    pub kind: OomKind,
    /// What the caller asked for.
    pub requested_bytes: u64,
    /// What the message says it "tried to allocate": the segment size, `get_allocation_size`
    /// of the rounded request (20 MiB for a 5 MiB request).
    pub tried_to_allocate: u64,
    /// The device's capacity, when known.
    pub capacity: Option<u64>,
    /// The `per_process_memory_fraction` limit, when one is set.
    pub allowed: Option<u64>,
    /// `allocated_bytes` when it failed (after the cached blocks were released).
    pub allocated_bytes: u64,
    /// `reserved_bytes` when it failed.
    pub reserved_bytes: u64,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            OomKind::OverOneExabyte => {
                return f.write_str("CUDA out of memory. Tried to allocate more than 1EB memory.");
            }
            OomKind::Rejected => {
                return write!(
                    f,
                    "CUDA out of memory. Allocation was preemptively rejected because it would exceed \
                     per_process_memory_fraction limit. Requested size: {}",
                    format_size(self.requested_bytes)
                );
            }
            OomKind::Device => {}
        }
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}.",
            format_size(self.tried_to_allocate)
        )?;
        if let Some(capacity) = self.capacity {
            let free = capacity.saturating_sub(self.reserved_bytes);
            write!(
                f,
                " GPU 0 has a total capacity of {} of which {} is free.",
                format_size(capacity),
                format_size(free)
            )?;
        }
        if let Some(allowed) = self.allowed {
            write!(f, " {} allowed;", format_size(allowed))?;
        }
        write!(
            f,
            " Of the allocated memory {} is allocated by PyTorch, and {} is reserved by PyTorch but unallocated.",
            format_size(self.allocated_bytes),
            format_size(self.reserved_bytes - self.allocated_bytes)
        )
    }
}

impl std::error::Error for OutOfMemory {}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    OutOfMemory(OutOfMemory),
    #[error("allocating id {id}: that id is still allocated (free it first)")]
    LiveId { id: u64 },
    #[error("freeing id {id}: no live allocation has that id")]
    UnknownId { id: u64 },
}

/// PyTorch's `format_size` (CUDACachingAllocator.cpp): up to 1024 in bytes, then KiB up to
/// 1 MiB, MiB up to 1 GiB, GiB above, with two decimals.
pub fn format_size(size: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    let v = size as f64;
    if size <= KIB {
        format!("{size} bytes")
    } else if size <= MIB {
        format!("{:.2} KiB", v / KIB as f64)
    } else if size <= GIB {
        format!("{:.2} MiB", v / MIB as f64)
    } else {
        format!("{:.2} GiB", v / GIB as f64)
    }
}
