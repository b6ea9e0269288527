//! A model architecture: one of the families and its configuration, as the built-ins, the
//! state-dict loader and Hugging Face configs describe models.

use std::fmt;

use crate::chain::Chain;
use crate::error::Result;
use crate::options::ModelOptions;
use crate::{bert, gpt2, llama, resnet};

/// A model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    ResNet,
    Bert,
    Gpt2,
    /// Llama, Mistral and Qwen2 (one module tree).
    Llama,
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::ResNet => "resnet",
            Family::Bert => "bert",
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
        })
    }
}

/// A model architecture: a family and its configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum Architecture {
    ResNet(resnet::Config),
    Bert(bert::Config),
    Gpt2(gpt2::Config),
    Llama(llama::Config),
}

impl Architecture {
    pub fn family(&self) -> Family {
        match self {
            Architecture::ResNet(_) => Family::ResNet,
            Architecture::Bert(_) => Family::Bert,
            Architecture::Gpt2(_) => Family::Gpt2,
            Architecture::Llama(_) => Family::Llama,
        }
    }

    /// The reference name of the configuration (`resnet50`) or its explicit shape.
    pub fn describe(&self) -> String {
        match self {
            Architecture::ResNet(c) => c.describe(),
            Architecture::Bert(c) => c.describe(),
            Architecture::Gpt2(c) => c.describe(),
            Architecture::Llama(c) => c.describe(),
        }
    }

    /// Parameter count of the reference model.
    pub fn param_count(&self) -> i64 {
        match self {
            Architecture::ResNet(c) => c.param_count(),
            Architecture::Bert(c) => c.param_count(),
            Architecture::Gpt2(c) => c.param_count(),
            Architecture::Llama(c) => c.param_count(),
        }
    }

    /// Builds the architecture as a chain named `name` with the family's default shapes.
    pub fn build(&self, name: &str, opts: &ModelOptions) -> Result<Chain> {
        match self {
            Architecture::ResNet(c) => resnet::build(name, c, opts),
            Architecture::Bert(c) => bert::build(name, c, opts),
            Architecture::Gpt2(c) => gpt2::build(name, c, opts),
            Architecture::Llama(c) => llama::build(name, c, opts),
        }
    }
}
