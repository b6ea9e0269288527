//! The simulated allocator (`DeviceCachingAllocator` for one device): its state, `malloc`
//! (`DeviceCachingAllocator::malloc`: best fit, else a new segment with the retries before an
//! out-of-memory error), `free`, `empty_cache` and the statistics.

use std::collections::{BTreeSet, HashMap};

use super::block::{Arena, BlockId, PoolKind};
use super::config::{AllocatorConfig, ConfigError};
use super::error::{OomKind, OutOfMemory, SimError};
use super::expandable_segment::ExpandableSegment;
use super::pool::BlockPool;
use super::sizes::{allocation_size, round_size};
use super::stats::Stats;

/// `NativeCachingAllocator::allocate` refuses 1 EiB or more outright.
const ONE_EXABYTE: u64 = 1 << 60;
/// Where simulated addresses start; any nonzero value would do.
const FIRST_ADDRESS: u64 = 1 << 32;

/// The caching allocator of one device, replaying allocations by caller-chosen ids.
#[derive(Debug)]
pub struct Simulator {
    pub(super) config: AllocatorConfig,
    /// What cudaMalloc can hand this process; `None`: unlimited.
    pub(super) capacity: Option<u64>,
    /// `allowed_memory_maximum`: set when `per_process_memory_fraction` is below 1.
    pub(super) allowed_max: Option<u64>,
    pub(super) arena: Arena,
    pub(super) pools: [BlockPool; 2],
    /// Live expandable segments by index (`expandable_segments_`).
    pub(super) segments: Vec<Option<ExpandableSegment>>,
    pub(super) stats: Stats,
    /// `total_allocated_memory`: bytes held from the device, equal to reserved bytes.
    pub(super) total_allocated: u64,
    next_address: u64,
    live: HashMap<u64, Option<BlockId>>,
    streams: BTreeSet<u32>,
}

/// One request on its way through `malloc` (`AllocParams`).
#[derive(Debug)]
pub(super) struct Request {
    pub stream: u32,
    /// The caller's size.
    pub requested: u64,
    /// `round_size` of it.
    pub size: u64,
    pub pool: PoolKind,
    /// `get_allocation_size`: the segment a cudaMalloc would get.
    pub alloc_size: u64,
    /// Set when `throw_on_cudamalloc_oom` refused it (`oom_rejection_info.rejected`).
    pub rejected: bool,
}

impl Simulator {
    /// An empty allocator. `capacity` is what cudaMalloc can give this process (the device's
    /// memory less what the CUDA context and other processes hold); `None` never runs out.
    /// `per_process_memory_fraction` below 1 and `throw_on_cudamalloc_oom` are limits taken of
    /// it, so they need one.
    pub fn new(config: AllocatorConfig, capacity: Option<u64>) -> Result<Simulator, ConfigError> {
        let fraction = config.per_process_memory_fraction;
        if capacity.is_none() {
            if fraction < 1.0 {
                return Err(ConfigError::NeedsCapacity {
                    key: "per_process_memory_fraction",
                });
            }
            if config.throw_on_cudamalloc_oom {
                return Err(ConfigError::NeedsCapacity {
                    key: "throw_on_cudamalloc_oom",
                });
            }
        }
        // DeviceCachingAllocator::setMemoryFraction: a limit only below 1.
        let allowed_max = capacity
            .filter(|_| fraction < 1.0)
            .map(|c| (fraction * c as f64) as u64);
        Ok(Simulator {
            config,
            capacity,
            allowed_max,
            arena: Arena::default(),
            pools: [BlockPool::default(), BlockPool::default()],
            segments: Vec::new(),
            stats: Stats::default(),
            total_allocated: 0,
            next_address: FIRST_ADDRESS,
            live: HashMap::new(),
            streams: BTreeSet::new(),
        })
    }

    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// `torch.empty(bytes, dtype=torch.uint8, device="cuda")` on `stream`, remembered as `id`.
    /// Zero bytes allocate nothing (`NativeCachingAllocator::allocate` skips them). On an
    /// out-of-memory error the state keeps what the retries released, as PyTorch's does.
    pub fn malloc(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(), SimError> {
        if self.live.contains_key(&id) {
            return Err(SimError::LiveId { id });
        }
        let block = match bytes {
            0 => None,
            _ => Some(self.allocate(bytes, stream).map_err(SimError::OutOfMemory)?),
        };
        self.live.insert(id, block);
        Ok(())
    }

    /// Frees allocation `id` (`DeviceCachingAllocator::free`): its block returns to the cache,
    /// merged with free neighbours.
    pub fn free(&mut self, id: u64) -> Result<(), SimError> {
        let block = self.live.remove(&id).ok_or(SimError::UnknownId { id })?;
        if let Some(block) = block {
            self.release_allocation(block);
        }
        Ok(())
    }

    /// `torch.cuda.empty_cache()` (`emptyCache` → `release_cached_blocks`): returns every cached
    /// segment with nothing allocated in it, and every fully free page of expandable segments.
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    /// `torch.cuda.reset_peak_memory_stats()`.
    pub fn reset_peak(&mut self) {
        self.stats.reset_peaks();
    }

    /// `torch.cuda.memory_stats()`, with the largest cached free block (`cache_info_aux`).
    pub fn stats(&self) -> Stats {
        let largest = self
            .streams
            .iter()
            .flat_map(|s| self.pools.iter().filter_map(|p| p.largest(*s)))
            .max()
            .unwrap_or(0);
        Stats {
            largest_free_block: largest,
            ..self.stats.clone()
        }
    }

    /// The size of the block that serves live allocation `id` (its rounded size; 0 for a
    /// zero-byte one).
    pub fn block_size(&self, id: u64) -> Option<u64> {
        let block = *self.live.get(&id)?;
        Some(block.map_or(0, |b| self.arena[b].size))
    }

    fn allocate(&mut self, bytes: u64, stream: u32) -> Result<BlockId, OutOfMemory> {
        if bytes >= ONE_EXABYTE {
            return Err(self.out_of_memory(OomKind::OverOneExabyte, bytes, bytes));
        }
        self.streams.insert(stream);
        let size = round_size(bytes, &self.config);
        let mut request = Request {
            stream,
            requested: bytes,
            size,
            pool: PoolKind::for_size(size),
            alloc_size: allocation_size(size, &self.config),
            rejected: false,
        };
        let block = match self.get_free_block(&request) {
            Some(block) => block,
            None => self.get_new_block(&mut request)?,
        };
        let split = self.should_split(block, size);
        Ok(self.alloc_found_block(block, &request, split))
    }

    /// `get_free_block`: the best cached fit, ticking the pool's age clock when garbage
    /// collection is on.
    fn get_free_block(&mut self, r: &Request) -> Option<BlockId> {
        let gc = self.gc_enabled();
        let pool = &mut self.pools[r.pool as usize];
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        pool.take_best_fit(&self.arena, r.stream, r.size, &self.config)
    }

    /// malloc's path when nothing cached fits: garbage collection, then a new segment; if the
    /// device is full, release cached oversize blocks and retry, then release every cached
    /// segment (`release_cached_blocks`) and retry once more, then give up.
    fn get_new_block(&mut self, r: &mut Request) -> Result<BlockId, OutOfMemory> {
        if self.gc_enabled() {
            self.garbage_collect_cached_blocks();
        }
        if let Some(block) = self.alloc_block(r, false) {
            return Ok(block);
        }
        if !r.rejected {
            if self.release_available_cached_blocks(r) {
                if let Some(block) = self.alloc_block(r, false) {
                    return Ok(block);
                }
            }
            self.release_cached_blocks();
            if let Some(block) = self.alloc_block(r, true) {
                return Ok(block);
            }
        }
        let kind = if r.rejected { OomKind::Rejected } else { OomKind::Device };
        Err(self.out_of_memory(kind, r.requested, r.alloc_size))
    }

    /// malloc's garbage collection condition: a threshold and a memory fraction.
    pub(super) fn gc_enabled(&self) -> bool {
        self.allowed_max.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    fn out_of_memory(&mut self, kind: OomKind, requested: u64, tried: u64) -> OutOfMemory {
        if kind == OomKind::Device {
            self.stats.num_ooms += 1;
        }
        OutOfMemory {
            kind,
            requested_bytes: requested,
            tried_to_allocate: tried,
            capacity: self.capacity,
            allowed: self.allowed_max,
            allocated_bytes: self.stats.allocated_bytes.current,
            reserved_bytes: self.stats.reserved_bytes.current,
        }
    }

    /// A new, unused address range of `size` bytes: segments follow each other in the order
    /// they were made (cudaMalloc's own placement is not known).
    pub(super) fn fresh_address(&mut self, size: u64) -> u64 {
        let addr = self.next_address;
        self.next_address += size.next_multiple_of(super::constants::K_SMALL_BUFFER);
        addr
    }
}
