//! Model zoo: models as chains of named blocks whose names equal PyTorch's module names.
//!
//! Families, each mirroring its reference implementation: [`resnet`] (torchvision),
//! [`bert`], [`gpt2`] and [`llama`] (Hugging Face transformers; Llama, Mistral, Qwen2). [`zoo`]
//! builds them by CLI name, each an [`architecture`] built with [`options`]; [`load`] builds them
//! from files: state dicts ([`state_dict`] reads them, [`infer`] names their architecture) and
//! Hugging Face folders ([`hf`]); [`jit`] and [`export`] run TorchScript and `torch.export`
//! programs.
pub mod architecture;
mod assemble;
pub mod bert;
pub mod causal_lm;
pub mod chain;
mod decoder;
pub mod error;
pub mod export;
pub mod gpt2;
pub mod hf;
pub mod infer;
pub mod jit;
mod layers;
pub mod llama;
pub mod load;
pub mod options;
pub mod resnet;
mod rotary;
mod sdpa;
mod shapes;
pub mod state_dict;
pub mod toy;
mod trace_kernels;
pub mod weights;
pub mod zoo;

pub use architecture::{Architecture, Family};
pub use assemble::Loaded;
pub use chain::{Batch, Block, BlockFailure, Chain, ChainBlock, ChainGroup, Ctx, InputSpec, LossHead, TokenTargets};
pub use error::ModelError;
pub use layers::Activation;
pub use load::{from_file, needs_meta};
pub use options::{Attention, Granularity, ModelOptions};
pub use sdpa::cuda_efficient as cuda_efficient_attention;
pub use trace_kernels::TraceKernels;
pub use zoo::{builtin, list, ModelInfo};
