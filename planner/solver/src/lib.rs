//! ckptune's planning core, with no libtorch anywhere in its dependency tree: the data a
//! profile holds ([`profile`]), the chain memory model over it ([`chain_model`], mapped from
//! a profile once in [`model`]), the exact solver ([`solver`]), checkpoint-regex emission
//! ([`regex_emit`]), byte sizes ([`budget`]), the cost model's device rates ([`rates`]) and a
//! simulation of PyTorch's CUDA caching allocator ([`caching_allocator`]). Everything takes
//! plain structs and returns plain structs, and only [`formats`] (feature `serde`) does I/O.
//! The derivation of the memory model is in `docs/memory-model.md`, the cost model's in
//! `docs/cost-model.md`.

pub mod budget;
pub mod caching_allocator;
pub mod chain_model;
pub mod cuda_overheads;
#[cfg(feature = "serde")]
pub mod formats;
pub mod gpus;
pub mod model;
pub mod names;
pub mod problem;
pub mod profile;
pub mod rates;
pub mod regex_emit;
pub mod shard;
pub mod solver;
#[cfg(feature = "testing")]
pub mod testing;
