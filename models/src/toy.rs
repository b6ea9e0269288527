//! A toy chain with analytically known memory, for the runtime's and planner's exact tests:
//! PyTorch's `nn.Sequential` of blocks `layers.N`, each `Linear → [BatchNorm1d] → ReLU →
//! [Dropout]`, and a `head` Linear with a cross-entropy loss.
//!
//! With neither BatchNorm nor dropout, a block's grad-mode forward keeps exactly its ReLU
//! output (`batch × width` f32; `addmm` saves only its inputs, which are not new) and peaks at
//! twice that (the `addmm` result and the ReLU output coexist).

use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

use crate::chain::{Batch, Block, Chain, ChainBlock, Ctx, InputSpec, LossHead};

/// Shape and features of the toy chain.
#[derive(Debug, Clone, PartialEq)]
pub struct ToyConfig {
    pub width: i64,
    pub blocks: usize,
    pub classes: i64,
    pub batch_norm: bool,
    pub dropout: f64,
}

impl Default for ToyConfig {
    fn default() -> Self {
        Self {
            width: 64,
            blocks: 4,
            classes: 10,
            batch_norm: false,
            dropout: 0.0,
        }
    }
}

struct ToyBlock {
    weight: Tensor,
    bias: Tensor,
    bn: Option<nn::BatchNorm>,
    dropout: f64,
}

impl Block for ToyBlock {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        // F.linear on 2-D input is addmm(bias, x, weight.T).
        let mut h = self.bias.addmm(xs, &self.weight.tr());
        if let Some(bn) = &self.bn {
            h = bn.forward_t(&h, ctx.train);
        }
        h = h.relu();
        if self.dropout > 0.0 {
            h = h.dropout(self.dropout, ctx.train);
        }
        h
    }
}

struct CrossEntropyHead {
    fc: nn::Linear,
}

impl LossHead for CrossEntropyHead {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Tensor {
        self.fc.forward(output).cross_entropy_for_logits(&batch.target)
    }
}

/// Builds the toy chain `toy` with random weights (seeded by the caller's `tch::manual_seed`).
pub fn toy(cfg: &ToyConfig, device: tch::Device) -> Chain {
    let vs = nn::VarStore::new(device);
    let root = vs.root();
    let layers = &root / "layers";
    let mut blocks = Vec::new();
    let mut modules = vec!["layers".to_owned()];
    for i in 0..cfg.blocks {
        let p = &layers / i;
        let lin = &p / 0;
        let bound = 1.0 / (cfg.width as f64).sqrt();
        let weight = lin.var(
            "weight",
            &[cfg.width, cfg.width],
            nn::Init::Uniform { lo: -bound, up: bound },
        );
        let bias = lin.var("bias", &[cfg.width], nn::Init::Uniform { lo: -bound, up: bound });
        modules.push(format!("layers.{i}"));
        modules.push(format!("layers.{i}.0"));
        let mut k = 1;
        let bn = cfg.batch_norm.then(|| {
            modules.push(format!("layers.{i}.{k}"));
            let bn = nn::batch_norm1d(&p / k, cfg.width, Default::default());
            k += 1;
            bn
        });
        modules.push(format!("layers.{i}.{k}"));
        k += 1;
        if cfg.dropout > 0.0 {
            modules.push(format!("layers.{i}.{k}"));
        }
        blocks.push(ChainBlock {
            extra_reads: Vec::new(),
            name: format!("layers.{i}"),
            candidate: true,
            skips: Vec::new(),
            block: Box::new(ToyBlock {
                weight,
                bias,
                bn,
                dropout: cfg.dropout,
            }),
        });
    }
    let fc = nn::linear(&root / "head", cfg.width, cfg.classes, Default::default());
    modules.push("head".to_owned());
    let reference_params = (cfg.width * cfg.width + cfg.width) * cfg.blocks as i64
        + if cfg.batch_norm {
            2 * cfg.width * cfg.blocks as i64
        } else {
            0
        }
        + cfg.width * cfg.classes
        + cfg.classes;
    Chain {
        name: "toy".to_owned(),
        vs,
        blocks,
        groups: Vec::new(),
        head: Box::new(CrossEntropyHead { fc }),
        modules,
        input: InputSpec::Features {
            features: cfg.width,
            classes: cfg.classes,
        },
        reference_params,
        attention: None,
        shared: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_matches_the_formula() {
        let c = toy(
            &ToyConfig {
                batch_norm: true,
                ..Default::default()
            },
            tch::Device::Cpu,
        );
        assert_eq!(c.param_count(), c.reference_params);
        assert_eq!(c.candidates(), ["layers.0", "layers.1", "layers.2", "layers.3"]);
        assert_eq!(
            c.input,
            InputSpec::Features {
                features: 64,
                classes: 10
            }
        );
    }
}
