//! Getting and returning device memory: a new segment (`alloc_block`, cudaMalloc or a
//! mapping of expandable pages), and the three ways cached segments go back to the device —
//! `release_available_cached_blocks` (oversize blocks, before a retry),
//! `release_cached_blocks` (`empty_cache`, before the last retry) and
//! `garbage_collect_cached_blocks` (the oldest cached segments, under a memory fraction).

use super::block::{Block, BlockId, PoolKind};
use super::simulator::{Request, Simulator};

impl Simulator {
    /// `alloc_block`: a new segment for request `r` unless the fraction's limit, the
    /// `throw_on_cudamalloc_oom` check or the device says no. The block is not in a pool.
    pub(super) fn alloc_block(&mut self, r: &mut Request, is_retry: bool) -> Option<BlockId> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        let size = r.alloc_size;
        if self.allowed_max.is_some_and(|max| self.total_allocated + size > max) {
            return None;
        }
        if self.config.throw_on_cudamalloc_oom {
            let capacity = self
                .capacity
                .expect("Simulator::new requires a capacity for throw_on_cudamalloc_oom");
            let max_allowed = (self.config.per_process_memory_fraction * capacity as f64) as u64;
            if self.total_allocated + size > max_allowed {
                self.stats.num_oom_rejections += 1;
                r.rejected = true;
                return None;
            }
        }
        if self.config.expandable_segments {
            return self.try_allocate_expandable_block(r);
        }
        if !self.device_has(size) {
            return None;
        }
        let addr = self.fresh_address(size);
        let id = self.arena.insert(Block::new(r.stream, size, addr, r.pool));
        self.total_allocated += size;
        self.stats.segment.increase(1);
        self.stats.reserved_bytes.increase(size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        Some(id)
    }

    /// Whether the device could give `bytes` more (cudaMalloc or cuMemCreate succeed).
    pub(super) fn device_has(&self, bytes: u64) -> bool {
        self.capacity.is_none_or(|c| self.total_allocated + bytes <= c)
    }

    /// `release_block`: cudaFree of a cached whole segment.
    fn release_block(&mut self, id: BlockId) {
        let b = &self.arena[id];
        debug_assert!(
            !b.is_split() && b.expandable.is_none(),
            "only whole cudaMalloc segments are freed"
        );
        self.pools[b.pool as usize].erase(b);
        let size = self.arena.remove(id).size;
        self.total_allocated -= size;
        self.stats.segment.decrease(1);
        self.stats.reserved_bytes.decrease(size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.stats.num_device_free += 1;
    }

    /// `release_available_cached_blocks`: with a `max_split_size`, frees one cached oversize
    /// segment of the request's stream at least as large as the request (or as
    /// `max_split_size`), else the largest ones until they add up to that; true when they did.
    pub(super) fn release_available_cached_blocks(&mut self, r: &Request) -> bool {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key_size = r.size.max(max_split);
        let pool = &self.pools[r.pool as usize];
        let (chosen, enough) = pool.oversize_to_release(&self.arena, r.stream, key_size, max_split);
        for id in chosen {
            self.release_block(id);
        }
        enough
    }

    /// `release_cached_blocks` (and `emptyCache`): `release_blocks` of the large pool, then
    /// of the small one.
    pub(super) fn release_cached_blocks(&mut self) {
        self.release_blocks(PoolKind::Large);
        self.release_blocks(PoolKind::Small);
    }

    /// `release_blocks`: frees every cached segment that is one whole free block, and unmaps
    /// the fully free pages of expandable segments, dropping a segment left with nothing
    /// mapped.
    fn release_blocks(&mut self, pool: PoolKind) {
        let mut to_unmap = Vec::new();
        for id in self.pools[pool as usize].ids() {
            let b = &self.arena[id];
            if b.expandable.is_some() {
                to_unmap.push(id);
            } else if !b.is_split() {
                self.release_block(id);
            }
        }
        for id in to_unmap {
            self.unmap_block(id);
            let b = &self.arena[id];
            if !b.mapped && !b.is_split() {
                self.release_expandable_segment(id);
            }
        }
    }

    /// `garbage_collect_cached_blocks`: once reserved bytes pass `garbage_collection_threshold`
    /// of the allowed memory, frees cached whole segments of the large pool that have waited
    /// at least the average age (in pool searches since they were cached), again while some
    /// were freed and less than the excess was reclaimed.
    pub(super) fn garbage_collect_cached_blocks(&mut self) {
        let Some(allowed) = self.allowed_max else { return };
        let gc_threshold = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        if self.total_allocated <= gc_threshold {
            return;
        }
        let target = self.total_allocated - gc_threshold;
        let large = PoolKind::Large as usize;
        let clock = self.pools[large].get_free_blocks_call_count;
        let age = |b: &Block| clock - b.gc_count_base;
        let (mut total_age, mut freeable) = (0u64, 0u64);
        for id in self.pools[large].ids() {
            let b = &self.arena[id];
            if !b.is_split() {
                total_age += age(b);
                freeable += 1;
            }
        }
        let (mut reclaimed, mut freed) = (0, true);
        while reclaimed < target && freed && freeable > 0 {
            let age_threshold = total_age as f64 / freeable as f64;
            freed = false;
            for id in self.pools[large].ids() {
                let b = &self.arena[id];
                if !b.is_split() && b.expandable.is_none() && age(b) as f64 >= age_threshold {
                    freed = true;
                    reclaimed += b.size;
                    total_age -= age(b);
                    freeable -= 1;
                    self.release_block(id);
                }
            }
        }
    }
}
