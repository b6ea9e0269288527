//! Handing a block out and taking it back: splitting a block larger than the request
//! (`should_split`, `alloc_found_block`) and merging a freed block with its free neighbours
//! (`free`, `free_block`, `try_merge_blocks`), with the statistics each step changes.

use super::block::{BlockId, PoolKind};
use super::constants::{K_MIN_BLOCK_SIZE, K_SMALL_SIZE};
use super::simulator::{Request, Simulator};

impl Simulator {
    /// `should_split`: in the small pool and in expandable segments, when at least 512 bytes
    /// would remain; in the large pool, when the request is below `max_split_size` and more
    /// than 1 MiB (`kSmallSize`) would remain.
    pub(super) fn should_split(&self, block: BlockId, size: u64) -> bool {
        let b = &self.arena[block];
        let remaining = b.size - size;
        if b.pool == PoolKind::Small || self.config.expandable_segments {
            remaining >= K_MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > K_SMALL_SIZE
        }
    }

    /// `alloc_found_block`: hands out `block` (out of its pool), first cutting the request off
    /// its front when `split`, the rest going back to the pool.
    pub(super) fn alloc_found_block(&mut self, block: BlockId, r: &Request, split: bool) -> BlockId {
        let already_split = self.arena[block].is_split();
        let expandable = self.arena[block].expandable.is_some();
        let handed = if split {
            self.split_front(block, r.size, already_split, expandable)
        } else {
            if already_split && !expandable {
                // An already-split block is becoming active.
                self.stats.inactive_split_bytes.decrease(self.arena[block].size);
                self.stats.inactive_split.decrease(1);
            }
            block
        };
        let b = &mut self.arena[handed];
        b.allocated = true;
        b.requested = r.requested;
        let size = b.size;
        self.stats.allocation.increase(1);
        self.stats.allocated_bytes.increase(size);
        self.stats.active.increase(1);
        self.stats.active_bytes.increase(size);
        self.stats.requested_bytes.increase(r.requested);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.increase(1);
        }
        handed
    }

    /// A new block of `size` at the front of `rest`, which shrinks and is cached again.
    fn split_front(&mut self, rest: BlockId, size: u64, already_split: bool, expandable: bool) -> BlockId {
        let r = &self.arena[rest];
        let (front, prev) = (r.sibling(size, r.addr), r.prev);
        let id = self.arena.insert(front);
        self.arena.splice(id, prev, Some(rest));
        let r = &mut self.arena[rest];
        r.addr += size;
        r.size -= size;
        let (remaining, pool) = (r.size, r.pool);
        self.pools[pool as usize].insert(&mut self.arena, rest);
        // Expandable segments are left out of inactive_split, as in PyTorch.
        if already_split && !expandable {
            // An already-split inactive block is being shrunk by size bytes.
            self.stats.inactive_split_bytes.decrease(size);
        } else if !expandable {
            // A new split inactive block is being created from a previously unsplit block.
            self.stats.inactive_split_bytes.increase(remaining);
            self.stats.inactive_split.increase(1);
        }
        id
    }

    /// `DeviceCachingAllocator::free` of a live block: no other stream used it (traces have
    /// no `record_stream`), so it is cached at once.
    pub(super) fn release_allocation(&mut self, block: BlockId) {
        let b = &mut self.arena[block];
        b.allocated = false;
        let size = b.size;
        self.stats.allocation.decrease(1);
        self.stats.allocated_bytes.decrease(size);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        self.free_block(block);
    }

    /// `free_block`: merges the block with its free neighbours and caches it.
    fn free_block(&mut self, block: BlockId) {
        let b = &self.arena[block];
        let (size, requested, pool, candidates) = (b.size, b.requested, b.pool, [b.prev, b.next]);
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        for candidate in candidates {
            let subsumed = self.try_merge_blocks(block, candidate);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        self.pools[pool as usize].insert(&mut self.arena, block);
        let b = &self.arena[block];
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        if b.expandable.is_none() {
            apply_net(&mut self.stats.inactive_split, net_blocks);
            apply_net(&mut self.stats.inactive_split_bytes, net_bytes);
        }
        self.stats.active.decrease(1);
        self.stats.active_bytes.decrease(size);
        self.stats.requested_bytes.decrease(requested);
    }

    /// `try_merge_blocks`: absorbs neighbour `src` into `dst` when it is free and as mapped as
    /// `dst`; returns the bytes absorbed (0: no merge). `dst` must be out of the pool's sets.
    pub(super) fn try_merge_blocks(&mut self, dst: BlockId, src: Option<BlockId>) -> u64 {
        let Some(src) = src else { return 0 };
        let s = &self.arena[src];
        if s.allocated || s.mapped != self.arena[dst].mapped {
            return 0;
        }
        let pool = &mut self.pools[s.pool as usize];
        if s.mapped {
            pool.erase(s);
        } else {
            pool.erase_unmapped(s);
        }
        let s = self.arena.remove(src);
        let d = &mut self.arena[dst];
        if d.prev == Some(src) {
            // [src dst]
            d.addr = s.addr;
            d.prev = s.prev;
            if let Some(p) = s.prev {
                self.arena[p].next = Some(dst);
            }
        } else {
            // [dst src]
            d.next = s.next;
            if let Some(n) = s.next {
                self.arena[n].prev = Some(dst);
            }
        }
        self.arena[dst].size += s.size;
        s.size
    }
}

fn apply_net(stat: &mut super::stats::Stat, change: i64) {
    if change > 0 {
        stat.increase(change as u64);
    } else if change < 0 {
        stat.decrease(change.unsigned_abs());
    }
}
