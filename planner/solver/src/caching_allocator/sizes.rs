//! How big a request becomes (`round_size`) and how big a segment it asks the device for
//! (`get_allocation_size`): the allocator's two size rules.

use super::config::AllocatorConfig;
use super::constants::{K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE};

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
