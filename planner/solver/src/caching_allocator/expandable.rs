//! `expandable_segments:True`: one segment per stream and pool reserves address space for
//! 9/8 of the device and maps physical pages into it as needed — 2 MiB pages in the small
//! pool (`kSmallBuffer`), `large_segment_size` (20 MiB) pages in the large one. Reserved bytes
//! are the mapped pages: `map_block` adds them, `unmap_block` (on `empty_cache` and the last
//! retry before an out-of-memory error) takes back the fully free ones.

use super::block::{Block, BlockId, PoolKind};
use super::constants::K_SMALL_BUFFER;
use super::expandable_segment::ExpandableSegment;
use super::simulator::{Request, Simulator};

/// The device memory assumed for the address space of an expandable segment when the
/// simulation is given no capacity (PyTorch reserves 9/8 of `totalGlobalMem`).
const UNKNOWN_DEVICE_MEMORY: u64 = 1 << 40;

impl Simulator {
    /// `try_allocate_expandable_block`: finds room (`find_expandable_block`), maps the
    /// missing pages into it one unmapped range at a time, and returns the free block,
    /// taken out of its pool, of at least the request's size. If the device runs out midway
    /// the pages mapped so far stay mapped, as in PyTorch.
    pub(super) fn try_allocate_expandable_block(&mut self, r: &Request) -> Option<BlockId> {
        let mut candidate = self.find_expandable_block(r)?;
        if !self.arena[candidate].mapped {
            let len = self.arena[candidate].size.min(r.size);
            if !self.map_block(candidate, len) {
                return None;
            }
        }
        // Invariant: free -> unmapped -> …; mapping the next range merges it into the free one.
        while self.arena[candidate].size < r.size {
            let remaining = r.size - self.arena[candidate].size;
            let next = self.arena[candidate]
                .next
                .expect("the room found continues after the block");
            let len = remaining.min(self.arena[next].size);
            if !self.map_block(next, len) {
                return None;
            }
            candidate = next;
        }
        let b = &self.arena[candidate];
        self.pools[b.pool as usize].erase(b);
        Some(candidate)
    }

    /// `find_expandable_block`: the lowest-addressed unmapped range of the stream's segments
    /// (with the free block just before it) whose run of free and unmapped blocks holds the
    /// request; else a new segment.
    fn find_expandable_block(&mut self, r: &Request) -> Option<BlockId> {
        for unmapped in self.pools[r.pool as usize].unmapped_of(r.stream) {
            let start = match self.arena[unmapped].prev {
                Some(p) if !self.arena[p].allocated => p,
                _ => unmapped,
            };
            if self.free_run(start, r.size) >= r.size {
                return Some(start);
            }
        }
        self.new_expandable_segment(r)
    }

    /// The bytes of the free and unmapped blocks from `start` on, counted until `enough`.
    fn free_run(&self, start: BlockId, enough: u64) -> u64 {
        let mut bytes = 0;
        let mut cursor = Some(start);
        while let Some(b) = cursor.filter(|b| bytes < enough && !self.arena[*b].allocated) {
            bytes += self.arena[b].size;
            cursor = self.arena[b].next;
        }
        bytes
    }

    /// A new expandable segment for the request's stream and pool, wholly unmapped. `None`
    /// when even a whole segment could not hold the request.
    fn new_expandable_segment(&mut self, r: &Request) -> Option<BlockId> {
        let page = match r.pool {
            PoolKind::Small => K_SMALL_BUFFER,
            PoolKind::Large => self.config.large_segment_size,
        };
        let total = self.capacity.unwrap_or(UNKNOWN_DEVICE_MEMORY);
        let size = total.saturating_add(total / 8).div_ceil(page).saturating_mul(page);
        if size < r.size {
            return None;
        }
        let base = self.fresh_address(size);
        self.segments.push(Some(ExpandableSegment { base, page, size }));
        let block = Block {
            mapped: false,
            expandable: Some(self.segments.len() - 1),
            ..Block::new(r.stream, size, base, r.pool)
        };
        let id = self.arena.insert(block);
        self.pools[r.pool as usize].insert_unmapped(&self.arena[id], id);
        Some(id)
    }

    fn segment_of(&self, id: BlockId) -> &ExpandableSegment {
        let index = self.arena[id].expandable.expect("an expandable block");
        self.segments[index].as_ref().expect("a live expandable segment")
    }

    /// `map_block`: maps the pages under the first `len` bytes of unmapped block `id` (false
    /// when the device has no room for them), leaves the rest unmapped, merges the block with
    /// its free neighbours and caches it.
    fn map_block(&mut self, id: BlockId, len: u64) -> bool {
        let (begin, end) = self.segment_of(id).pages_covering(self.arena[id].addr, len);
        let mapped = (end - begin) * self.segment_of(id).page;
        if mapped == 0 || !self.device_has(mapped) {
            return false;
        }
        let b = &self.arena[id];
        self.pools[b.pool as usize].erase_unmapped(b);
        if mapped < b.size {
            let rest = Block {
                mapped: false,
                ..b.sibling(b.size - mapped, b.addr + mapped)
            };
            let next = b.next;
            let rest = self.arena.insert(rest);
            self.arena.splice(rest, Some(id), next);
            let pool = self.arena[rest].pool as usize;
            self.pools[pool].insert_unmapped(&self.arena[rest], rest);
            self.arena[id].size = mapped;
        }
        self.arena[id].mapped = true;
        let (prev, next, pool) = (self.arena[id].prev, self.arena[id].next, self.arena[id].pool as usize);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.pools[pool].insert(&mut self.arena, id);
        self.total_allocated += mapped;
        self.stats.reserved_bytes.increase(mapped);
        self.stats.num_device_alloc += 1;
        true
    }

    /// `unmap_block`: unmaps the pages wholly inside cached block `id` (nothing when there is
    /// none); the free bytes before and after them stay cached as blocks of their own, and the
    /// unmapped range merges with unmapped neighbours.
    pub(super) fn unmap_block(&mut self, id: BlockId) {
        let seg = self.segment_of(id);
        let b = &self.arena[id];
        let (begin, end) = seg.pages_inside(b.addr, b.size);
        if begin >= end {
            return;
        }
        let (start, len) = (seg.page_address(begin), (end - begin) * seg.page);
        let pool = b.pool as usize;
        self.pools[pool].erase(b);
        let (addr, size, prev, next) = (b.addr, b.size, b.prev, b.next);
        if start > addr {
            let before = self.arena.insert(self.arena[id].sibling(start - addr, addr));
            self.arena.splice(before, prev, Some(id));
            self.pools[pool].insert(&mut self.arena, before);
        }
        if addr + size > start + len {
            let after = self
                .arena
                .insert(self.arena[id].sibling(addr + size - start - len, start + len));
            self.arena.splice(after, Some(id), next);
            self.pools[pool].insert(&mut self.arena, after);
        }
        let b = &mut self.arena[id];
        (b.addr, b.size, b.mapped) = (start, len, false);
        let (prev, next) = (b.prev, b.next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.pools[pool].insert_unmapped(&self.arena[id], id);
        self.total_allocated -= len;
        self.stats.reserved_bytes.decrease(len);
        self.stats.num_device_free += 1;
    }

    /// `release_expandable_segment`: drops a segment that is one unmapped range.
    pub(super) fn release_expandable_segment(&mut self, id: BlockId) {
        let b = self.arena.remove(id);
        self.pools[b.pool as usize].erase_unmapped(&b);
        let index = b.expandable.expect("an expandable block");
        let segment = self.segments[index].take();
        debug_assert_eq!(segment.map(|s| s.size), Some(b.size), "the block is the whole segment");
    }
}
