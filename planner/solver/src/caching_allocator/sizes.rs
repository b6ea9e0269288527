//! How big a request becomes (`round_size`) and how big a segment it asks the device for
//! (`get_allocation_size`): the allocator's constants and its two size rules.

use super::config::AllocatorConfig;

/// `kMinBlockSize` (c10/core/AllocatorConfig.h): every size is rounded to at least 512 bytes.
pub const K_MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: the largest request the small pool serves, 1 MiB.
pub const K_SMALL_SIZE: u64 = 1 << 20;
/// `kSmallBuffer`: small requests are packed into 2 MiB segments (and expandable segments of
/// the small pool map 2 MiB pages).
pub const K_SMALL_BUFFER: u64 = 2 << 20;
/// `kMinLargeAlloc`: requests from 1 MiB up to below 10 MiB share `large_segment_size` segments.
pub const K_MIN_LARGE_ALLOC: u64 = 10 << 20;
/// `kRoundLarge`: segments of larger requests are rounded up to 2 MiB.
pub const K_ROUND_LARGE: u64 = 2 << 20;
/// `kLargeBuffer`: the default `large_segment_size` (`large_segment_size_mb`), 20 MiB, and
/// the default `max_non_split_rounding_size`.
pub const K_LARGE_BUFFER: u64 = 20 << 20;

/// `DeviceCachingAllocator::round_size`: below 512 bytes, 512; else, when the size's interval
/// has `roundup_power2_divisions` d > 1 and the size exceeds 512·d, up to the next of d equal
/// divisions between two powers of two; else up to a multiple of 512.
pub fn round_size(size: u64, config: &AllocatorConfig) -> u64 {
    if size < K_MIN_BLOCK_SIZE {
        return K_MIN_BLOCK_SIZE;
    }
    let divisions = config.roundup_power2_divisions_for(size);
    // `kMinBlockSize * divisions` cannot overflow in C++'s size_t for the values PyTorch
    // accepts in practice; here an overflowing product simply exceeds every size.
    let above = K_MIN_BLOCK_SIZE.checked_mul(divisions).is_some_and(|m| size > m);
    if divisions > 1 && above {
        roundup_power2_next_division(size, divisions)
    } else {
        size.div_ceil(K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
    }
}

/// `roundup_power2_next_division`: 1200 with 4 divisions lies between 1024 and 2048, whose
/// divisions are 1024, 1280, 1536, 1792, so it becomes 1280. A power of two stays; divisions
/// finer than one byte give the next power of two.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let power2_floor = 1u64 << (63 - size.leading_zeros());
    // `power2_floor >> log2(divisions)`: the parser only accepts powers of two.
    let division = power2_floor >> (63 - divisions.leading_zeros());
    if division == 0 {
        return power2_floor << 1;
    }
    let floor = size & !(division - 1);
    if floor == size {
        size
    } else {
        floor + division
    }
}

/// `DeviceCachingAllocator::get_allocation_size`: the segment a request of rounded `size`
/// asks the device for when no cached block fits — a 2 MiB small segment for the small pool,
/// one `large_segment_size` (20 MiB) segment shared by requests below 10 MiB, otherwise the
/// request rounded up to 2 MiB.
pub fn allocation_size(size: u64, config: &AllocatorConfig) -> u64 {
    if size <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if size < K_MIN_LARGE_ALLOC {
        config.large_segment_size
    } else {
        size.div_ceil(K_ROUND_LARGE) * K_ROUND_LARGE
    }
}
