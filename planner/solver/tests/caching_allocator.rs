//! The CUDA caching allocator simulation, one test per rule of c10/cuda/CUDACachingAllocator.cpp
//! (each names the function or constant it checks), a module per family of rules: sizes, pools
//! and blocks; device memory; expandable segments; traces. Every expected value is worked out by
//! hand from the source in the comments next to it. Then the configuration parser's errors, and
//! a randomized check against references computed independently of the allocator's counters.
//! The helpers here are what every module uses.

use ckptune_solver::caching_allocator::{
    replay, round_size, AllocatorConfig, ConfigError, OomKind, SimError, Simulator, Snapshot, TraceEvent,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn sim(conf: &str, capacity: Option<u64>) -> Simulator {
    Simulator::new(AllocatorConfig::parse(conf).unwrap(), capacity).unwrap()
}

fn alloc(s: &mut Simulator, id: u64, bytes: u64) {
    s.malloc(id, bytes, 0).unwrap();
}

fn free(s: &mut Simulator, id: u64) {
    s.free(id).unwrap();
}

fn oom(s: &mut Simulator, id: u64, bytes: u64) -> ckptune_solver::caching_allocator::OutOfMemory {
    match s.malloc(id, bytes, 0) {
        Err(SimError::OutOfMemory(e)) => e,
        other => panic!("expected an out-of-memory error, got {other:?}"),
    }
}

/// (allocated, reserved, segments, largest free block) now.
fn levels(s: &Simulator) -> (u64, u64, u64, u64) {
    let st = s.stats();
    (
        st.allocated_bytes.current,
        st.reserved_bytes.current,
        st.segment.current,
        st.largest_free_block,
    )
}

#[path = "caching_allocator/blocks.rs"]
mod blocks;
#[path = "caching_allocator/config.rs"]
mod config;
#[path = "caching_allocator/expandable.rs"]
mod expandable;
#[path = "caching_allocator/random.rs"]
mod random;
#[path = "caching_allocator/replay.rs"]
mod replay;
#[path = "caching_allocator/segments.rs"]
mod segments;
