//! A pool of cached blocks (`struct BlockPool`): the free, mapped blocks ordered by
//! (stream, size, address) as `BlockComparatorSize` orders `blocks`, so the first one at or
//! after (stream, size) is the best fit of that stream; and the unmapped ranges of expandable
//! segments ordered by (stream, address) as `BlockComparatorAddress` orders `unmapped`.

use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Included, Unbounded};

use super::block::{Arena, Block, BlockId};
use super::config::AllocatorConfig;

type SizeKey = (u32, u64, u64);

fn size_key(b: &Block) -> SizeKey {
    (b.stream, b.size, b.addr)
}

#[derive(Debug, Default)]
pub(super) struct BlockPool {
    blocks: BTreeMap<SizeKey, BlockId>,
    unmapped: BTreeMap<(u32, u64), BlockId>,
    /// `get_free_blocks_call_count`: searches of this pool while garbage collection is on,
    /// the clock of the blocks' ages.
    pub get_free_blocks_call_count: u64,
}

impl BlockPool {
    /// `insert_into_blocks`: caches a free mapped block and starts its age.
    pub(super) fn insert(&mut self, arena: &mut Arena, id: BlockId) {
        arena[id].gc_count_base = self.get_free_blocks_call_count;
        let fresh = self.blocks.insert(size_key(&arena[id]), id).is_none();
        debug_assert!(fresh, "a block cached twice");
    }

    pub(super) fn erase(&mut self, block: &Block) {
        let found = self.blocks.remove(&size_key(block)).is_some();
        debug_assert!(found, "erasing a block the pool does not hold");
    }

    pub(super) fn insert_unmapped(&mut self, block: &Block, id: BlockId) {
        self.unmapped.insert((block.stream, block.addr), id);
    }

    pub(super) fn erase_unmapped(&mut self, block: &Block) {
        let found = self.unmapped.remove(&(block.stream, block.addr)).is_some();
        debug_assert!(found, "erasing an unmapped range the pool does not hold");
    }

    /// `blocks.lower_bound(key)`: the first block at or after (stream, size, address 0), of
    /// any stream.
    fn lower_bound(&self, stream: u32, size: u64) -> Option<(SizeKey, BlockId)> {
        self.blocks.range((stream, size, 0)..).next().map(|(k, v)| (*k, *v))
    }

    fn after(&self, key: SizeKey) -> Option<(SizeKey, BlockId)> {
        self.blocks
            .range((Excluded(key), Unbounded))
            .next()
            .map(|(k, v)| (*k, *v))
    }

    fn before(&self, key: SizeKey) -> Option<(SizeKey, BlockId)> {
        self.blocks.range(..key).next_back().map(|(k, v)| (*k, *v))
    }

    /// The cached blocks in pool order.
    pub(super) fn ids(&self) -> Vec<BlockId> {
        self.blocks.values().copied().collect()
    }

    /// The unmapped ranges of `stream`, lowest address first.
    pub(super) fn unmapped_of(&self, stream: u32) -> Vec<BlockId> {
        self.unmapped
            .range((stream, 0)..=(stream, u64::MAX))
            .map(|(_, id)| *id)
            .collect()
    }

    /// The largest cached block of `stream` (`cache_info_aux`, one stream at a time).
    pub(super) fn largest(&self, stream: u32) -> Option<u64> {
        let range = (Included((stream, 0, 0)), Included((stream, u64::MAX, u64::MAX)));
        self.blocks.range(range).next_back().map(|(k, _)| k.1)
    }

    /// `get_free_block` after its clock tick: the best-fit cached block of `stream` for a
    /// rounded `size`, taken out of the pool, unless the oversize rules refuse it.
    pub(super) fn take_best_fit(
        &mut self,
        arena: &Arena,
        stream: u32,
        size: u64,
        config: &AllocatorConfig,
    ) -> Option<BlockId> {
        let (mut key, mut id) = self.lower_bound(stream, size).filter(|(k, _)| k.0 == stream)?;
        if arena[id].expandable.is_some() {
            (key, id) = self.prefer_less_expandable(arena, key, id);
        }
        // Blocks are expandable exactly when the configuration is (it cannot change during a
        // simulation), so get_free_block's branch for expandable blocks left over from a time
        // expandable_segments was on has no counterpart here.
        let found = arena[id].size;
        // "Do not return an oversized block for a large request"
        if size < config.max_split_size && found >= config.max_split_size {
            return None;
        }
        // "Allow oversized block size to be rounded up but within a limit"
        if size >= config.max_split_size && found >= size.saturating_add(config.max_non_split_rounding_size) {
            return None;
        }
        self.blocks.remove(&key);
        Some(id)
    }

    /// get_free_block with expandable segments: a block that ends at the segment's unmapped
    /// tail counts as the size it could grow to, so the search moves on to the next block of
    /// the stream while that one could grow to less.
    fn prefer_less_expandable(&self, arena: &Arena, mut key: SizeKey, mut id: BlockId) -> (SizeKey, BlockId) {
        let expandable_size = |b: BlockId| {
            let block = &arena[b];
            let tail = block.next.filter(|n| !arena[*n].mapped).map_or(0, |n| arena[n].size);
            block.size + tail
        };
        while arena[id].expandable.is_some() {
            match self.after(key) {
                Some((k, n)) if k.0 == key.0 && expandable_size(n) < expandable_size(id) => (key, id) = (k, n),
                _ => break,
            }
        }
        (key, id)
    }

    /// The blocks `release_available_cached_blocks` frees, and whether they are enough: a
    /// single cached block of `stream` of at least `key_size` when there is one (not
    /// expandable); else the stream's blocks from the largest down while they are oversize
    /// (at least `max_split_size`) and their sizes have not reached `key_size`, expandable ones
    /// passed over. PyTorch frees those even when they turn out not to be enough.
    pub(super) fn oversize_to_release(
        &self,
        arena: &Arena,
        stream: u32,
        key_size: u64,
        max_split_size: u64,
    ) -> (Vec<BlockId>, bool) {
        let found = self.lower_bound(stream, key_size);
        if let Some((_, id)) = found.filter(|(k, id)| k.0 == stream && arena[*id].expandable.is_none()) {
            return (vec![id], true);
        }
        // From the block just before where the lower bound stopped (the last block of the set
        // when it found nothing).
        let mut cursor = match found {
            Some((k, _)) => self.before(k),
            None => self.blocks.iter().next_back().map(|(k, v)| (*k, *v)),
        };
        let mut released = 0;
        let mut chosen = Vec::new();
        while let Some((k, id)) = cursor {
            if released >= key_size || k.1 < max_split_size || k.0 != stream {
                break;
            }
            if arena[id].expandable.is_none() {
                released += k.1;
                chosen.push(id);
            }
            cursor = self.before(k);
        }
        (chosen, released >= key_size)
    }
}
