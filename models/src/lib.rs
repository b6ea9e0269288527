//! Model zoo: models as chains of named blocks whose names equal PyTorch's module names.
//!
//! Families, each mirroring its reference implementation: [`resnet`] (torchvision),
//! [`bert`], [`gpt2`] and [`llama`] (Hugging Face transformers; Llama, Mistral, Qwen2). [`zoo`]
//! builds them by CLI name; [`load`] builds them from state-dict files, [`hf`] from Hugging Face
//! folders; [`jit`] and [`export`] run TorchScript and `torch.export` programs.
pub mod bert;
pub mod chain;
pub mod error;
pub mod export;
pub mod gpt2;
pub mod hf;
pub mod jit;
mod layers;
pub mod llama;
pub mod load;
pub mod resnet;
pub mod toy;
pub mod zoo;

pub use chain::{Batch, Block, Chain, ChainBlock, ChainGroup, Ctx, InputSpec, LossHead, TokenTargets};
pub use error::ModelError;
pub use layers::Activation;
pub use load::{from_file, Loaded};
pub use zoo::{builtin, list, Architecture, Family, Granularity, ModelInfo, ModelOptions};
