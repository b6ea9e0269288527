//! One expandable segment's address range and its pages (`struct ExpandableSegment`): the
//! type the simulator holds, below the simulator's methods that map and unmap its pages.

/// `struct ExpandableSegment`: an address range of `size` bytes from `base`, in pages of
/// `page` bytes. Which pages are mapped is recorded in the blocks covering it.
#[derive(Debug)]
pub(super) struct ExpandableSegment {
    pub(super) base: u64,
    pub(super) page: u64,
    pub(super) size: u64,
}

impl ExpandableSegment {
    /// `ExpandableSegment::map`'s pages: from the one holding `addr` (a page start) through
    /// the one holding the range's last byte.
    pub(super) fn pages_covering(&self, addr: u64, len: u64) -> (u64, u64) {
        debug_assert_eq!((addr - self.base) % self.page, 0, "mapping starts on a page");
        (
            (addr - self.base) / self.page,
            (addr + len - self.base).div_ceil(self.page),
        )
    }

    /// `ExpandableSegment::unmap`'s pages: those wholly inside the range.
    pub(super) fn pages_inside(&self, addr: u64, len: u64) -> (u64, u64) {
        (
            (addr - self.base).div_ceil(self.page),
            (addr + len - self.base) / self.page,
        )
    }

    pub(super) fn page_address(&self, page: u64) -> u64 {
        self.base + page * self.page
    }
}
