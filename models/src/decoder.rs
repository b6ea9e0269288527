//! A pre-norm decoder layer (GPT-2's `GPT2Block`, Llama's `LlamaDecoderLayer`) in a chain: one
//! block, or its forward statement by statement with the layer a group over them when nested.
//! GPT-2 and Llama differ in their modules, not in how a layer splits, so the split is here once.

use crate::chain::{Block, ChainBlock, ChainGroup};
use crate::options::Granularity;

/// A layer whose forward is `h = x + attn(norm_1(x)); h + mlp(norm_2(h))`.
pub(crate) trait PreNormLayer: Block + Sized + 'static {
    /// The children's module names under the layer: first norm, attention, second norm, MLP.
    const CHILDREN: [&'static str; 4];

    /// The children as blocks, in that order.
    fn split(self) -> [Box<dyn Block>; 4];

    /// A residual sum of the layer's forward (not a module): its input plus skip 0, in the
    /// family's operand order.
    fn residual() -> Box<dyn Block>;
}

/// Pushes layer `name` as one candidate block (granularity `layer`), or as its children: the
/// norms and the residual sums are blocks but not candidates (checkpointing them saves
/// nothing), and each sum reads the residual as a skip: the layer's input, then the first sum.
/// Nested, the layer is also a group over its six blocks.
pub(crate) fn push_layer<L: PreNormLayer>(
    blocks: &mut Vec<ChainBlock>,
    groups: &mut Vec<ChainGroup>,
    name: String,
    layer: L,
    granularity: Granularity,
) {
    if granularity == Granularity::Layer {
        blocks.push(ChainBlock::new(name, true, Box::new(layer)));
        return;
    }
    let [norm_1, attn, norm_2, mlp] = L::CHILDREN;
    let [norm_1_block, attn_block, norm_2_block, mlp_block] = layer.split();
    let first = blocks.len();
    blocks.push(ChainBlock::new(format!("{name}.{norm_1}"), false, norm_1_block));
    blocks.push(ChainBlock::new(format!("{name}.{attn}"), true, attn_block));
    blocks.push(ChainBlock {
        extra_reads: Vec::new(),
        name: format!("{name} (attn residual)"),
        candidate: false,
        skips: vec![first - 1],
        block: L::residual(),
    });
    blocks.push(ChainBlock::new(format!("{name}.{norm_2}"), false, norm_2_block));
    blocks.push(ChainBlock::new(format!("{name}.{mlp}"), true, mlp_block));
    blocks.push(ChainBlock {
        extra_reads: Vec::new(),
        name: format!("{name} (mlp residual)"),
        candidate: false,
        skips: vec![first + 2],
        block: L::residual(),
    });
    if granularity == Granularity::Nested {
        groups.push(ChainGroup {
            name,
            first,
            last: first + 5,
        });
    }
}
