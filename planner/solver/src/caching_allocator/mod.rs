//! A simulation of PyTorch 2.13's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`,
//! the `native` backend): replays a training step's allocations and frees, in order and per
//! stream, and predicts what `torch.cuda.memory_stats()` reports after each one — allocated,
//! reserved, active and requested bytes, segments — and the largest cached free block, without
//! a GPU. Users run out of memory at the allocator's *reserved* bytes (its cached segments),
//! which rounding, segment sizes and fragmentation put above the tensors' bytes.
//!
//! Written from PyTorch's source, each rule in Rust from the C++ function it cites:
//! the newest `CUDACachingAllocator.cpp` the search index holds (168,130 bytes, the version
//! with `per_process_memory_fraction` and `large_segment_size_mb`), its core functions compared
//! with cyyever/pytorch@076f02792ce5 (after 2.13: unchanged apart from the preemptive
//! `throw_on_cudamalloc_oom` rejection, taken from there, which 2.13's `DeviceStats` already
//! counts), and `c10/core/AllocatorConfig.cpp` from Continuous-Integrator/pytorch@09384c1fb1d6
//! (2.13's `AllocatorConfig.h`). Constants are checked against the torch 2.13.0 wheel's headers
//! (git cf30153c). `docs/cuda-allocator.md` lists every rule and what is not simulated.
//!
//! Files, one job each: [`config`] parses `PYTORCH_CUDA_ALLOC_CONF`; `constants` and `sizes` round
//! requests and size segments; `block` and `pool` hold blocks and the best-fit sets; `place` splits
//! and merges blocks; `segments` gets and releases device memory (cudaMalloc, cudaFree, the
//! garbage collector); `expandable_segment` and `expandable` map and
//! unmap expandable segments' pages; [`stats`] is
//! `memory_stats()`; `simulator` ties them into `malloc`/`free`; `snapshot` is `memory_snapshot()`; `replay`
//! runs a trace; `recommend` picks the `PYTORCH_CUDA_ALLOC_CONF` to recommend (the lowest
//! reserved peak, or `expandable_segments:True` near it).
//! Pure and deterministic: no I/O, no libtorch.

mod block;
pub mod config;
mod constants;
mod error;
mod expandable;
mod expandable_segment;
mod place;
mod pool;
mod recommend;
mod replay;
mod segments;
mod simulator;
mod sizes;
mod snapshot;
pub mod stats;

pub use config::{AllocatorConfig, ConfigError};
pub use constants::{K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE};
pub use error::{format_size, OomKind, OutOfMemory, SimError};
pub use recommend::{peaks_by_conf, recommended, ConfPeaks, CANDIDATE_CONFS, EXPANDABLE_MARGIN_PERCENT};
pub use replay::{replay, Replay, Snapshot, SpanPeaks, Stop, TraceEvent};
pub use simulator::Simulator;
pub use sizes::{allocation_size, round_size};
pub use snapshot::{BlockInfo, SegmentInfo};
pub use stats::{Stat, Stats};
