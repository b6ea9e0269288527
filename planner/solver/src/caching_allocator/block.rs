//! Blocks (`struct Block` of CUDACachingAllocator.cpp): a range of a segment, allocated or
//! free, linked to its neighbours in the segment. They live in an arena and are named by
//! index, as the C++ names them by pointer, so a block keeps its identity when it grows
//! by merging or moves its start.

/// A block's index in the [`Arena`].
pub(super) type BlockId = usize;

/// The two pools of `DeviceCachingAllocator`: `small_blocks` (requests up to 1 MiB) and
/// `large_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PoolKind {
    Small = 0,
    Large = 1,
}

impl PoolKind {
    /// `get_pool`: by the rounded size.
    pub(super) fn for_size(size: u64) -> PoolKind {
        if size <= super::constants::K_SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Block {
    pub stream: u32,
    pub size: u64,
    /// What the caller asked for (`requested_size`), while allocated.
    pub requested: u64,
    /// Simulated device address: unique among live blocks, ordered within a segment.
    pub addr: u64,
    pub pool: PoolKind,
    pub allocated: bool,
    /// Backed by physical pages; false only for the unmapped ranges of expandable segments.
    pub mapped: bool,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    /// The expandable segment the block belongs to, if any.
    pub expandable: Option<usize>,
    /// The pool's `get_free_blocks_call_count` when the block was last cached (`gc_count_base`).
    pub gc_count_base: u64,
}

impl Block {
    /// A free, mapped block that is a whole segment, as cudaMalloc returns it.
    pub(super) fn new(stream: u32, size: u64, addr: u64, pool: PoolKind) -> Block {
        Block {
            stream,
            size,
            requested: 0,
            addr,
            pool,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            expandable: None,
            gc_count_base: 0,
        }
    }

    /// A block's sibling in the same segment at `addr`: same stream, pool and segment.
    pub(super) fn sibling(&self, size: u64, addr: u64) -> Block {
        Block {
            expandable: self.expandable,
            ..Block::new(self.stream, size, addr, self.pool)
        }
    }

    /// `Block::is_split`: part of a segment that holds other blocks.
    pub(super) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// Storage for blocks; freed slots are reused.
#[derive(Debug, Default)]
pub(super) struct Arena {
    slots: Vec<Option<Block>>,
    vacant: Vec<BlockId>,
}

impl Arena {
    pub(super) fn insert(&mut self, block: Block) -> BlockId {
        match self.vacant.pop() {
            Some(id) => {
                self.slots[id] = Some(block);
                id
            }
            None => {
                self.slots.push(Some(block));
                self.slots.len() - 1
            }
        }
    }

    pub(super) fn remove(&mut self, id: BlockId) -> Block {
        let block = self.slots[id].take().expect("removing a block that exists");
        self.vacant.push(id);
        block
    }

    /// Makes `id` the block between `before` and `after` (`Block::splice`).
    pub(super) fn splice(&mut self, id: BlockId, before: Option<BlockId>, after: Option<BlockId>) {
        if let Some(b) = before {
            self[b].next = Some(id);
        }
        if let Some(a) = after {
            self[a].prev = Some(id);
        }
        self[id].prev = before;
        self[id].next = after;
    }

    /// Every live block (for checks and tests).
    pub(super) fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i, b)))
    }
}

impl std::ops::Index<BlockId> for Arena {
    type Output = Block;
    fn index(&self, id: BlockId) -> &Block {
        self.slots[id].as_ref().expect("a live block")
    }
}

impl std::ops::IndexMut<BlockId> for Arena {
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id].as_mut().expect("a live block")
    }
}
