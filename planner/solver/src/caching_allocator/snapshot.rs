//! `torch.cuda.memory_snapshot()`'s segments: every segment with its blocks, for looking at
//! fragmentation and for checking the layout (`DeviceCachingAllocator::snapshot`).

use super::block::PoolKind;
use super::simulator::Simulator;

/// One segment: a cudaMalloc'd one, or one contiguous mapped range of an expandable segment
/// (as PyTorch reports those).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Simulated address: ordered as the segments were made.
    pub address: u64,
    pub total_size: u64,
    pub stream: u32,
    pub is_large: bool,
    pub is_expandable: bool,
    /// In address order, covering the segment without gaps.
    pub blocks: Vec<BlockInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: u64,
    pub size: u64,
    /// What the caller asked for (0 for a free block).
    pub requested_size: u64,
    pub allocated: bool,
}

impl Simulator {
    /// The segments, lowest address first.
    pub fn memory_snapshot(&self) -> Vec<SegmentInfo> {
        let heads = self.arena.iter().filter(|(_, b)| {
            let prev_mapped = b.prev.is_some_and(|p| self.arena[p].mapped);
            b.mapped && !prev_mapped
        });
        let mut segments: Vec<SegmentInfo> = heads
            .map(|(id, head)| {
                let mut blocks = Vec::new();
                let mut cursor = Some(id);
                while let Some(b) = cursor.map(|c| &self.arena[c]).filter(|b| b.mapped) {
                    blocks.push(BlockInfo {
                        address: b.addr,
                        size: b.size,
                        requested_size: if b.allocated { b.requested } else { 0 },
                        allocated: b.allocated,
                    });
                    cursor = b.next;
                }
                SegmentInfo {
                    address: head.addr,
                    total_size: blocks.iter().map(|b| b.size).sum(),
                    stream: head.stream,
                    is_large: head.pool == PoolKind::Large,
                    is_expandable: head.expandable.is_some(),
                    blocks,
                }
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        segments
    }
}
