//! The optimizer step in backward (`TrainConfig::optimizer_in_backward`): each parameter is
//! updated in its post-accumulate-grad hook, inside the autograd engine, as soon as its gradient
//! is complete, and its gradient is freed there (torchtune's `optimizer_in_bwd`: one optimizer
//! per parameter, `step()` then `zero_grad(set_to_none=True)` in the hook). Parameter gradients
//! then never all exist at once, and the step's temporaries are one parameter's, during
//! backward (docs/memory-model.md, "The optimizer step in backward").
//!
//! PyTorch runs one graph, so a parameter's hook fires once, when every use has added to it.
//! Here each block's backward is its own graph, so a parameter two units read (a tied
//! embedding, which the loss head reads too) is accumulated once per unit; its gradient is
//! complete after the last unit to run backward that reads it, the earliest in the chain: the
//! lowest block whose module owns it, or the loss head for a parameter of the head's own.

use std::cell::Cell;
use std::rc::Rc;

use ckptune_kernels::{autograd, fake, post_accumulate};
use ckptune_models::Chain;

use crate::error::Result;
use crate::optim::Optimizer;

/// The loss head as a backward unit.
const LOSS: usize = usize::MAX;

/// Which unit's backward completes each parameter's gradient, and which is running.
#[derive(Clone)]
pub(super) struct InBackward {
    /// Per parameter, in the optimizer's order: the block whose backward completes its gradient
    /// ([`LOSS`] for the loss head's own parameters).
    last_unit: Rc<[usize]>,
    /// The blocks `first..=last` whose backward runs now (one block, or a fused group), or
    /// `(LOSS, LOSS)` during the loss head's.
    running: Rc<Cell<(usize, usize)>>,
}

impl InBackward {
    /// Registers the hook of every parameter of `opt` (index = its place in `opt.params()`).
    pub(super) fn new(chain: &Chain, opt: &dyn Optimizer) -> Result<Self> {
        let named = chain.vs.variables();
        let prefixes: Vec<Vec<String>> = chain
            .blocks
            .iter()
            .map(|b| b.name.split('+').map(|n| format!("{n}.")).collect())
            .collect();
        let mut last_unit = Vec::with_capacity(opt.params().len());
        for (i, p) in opt.params().iter().enumerate() {
            let name = named
                .iter()
                .find(|(_, v)| fake::same_tensor(v, p))
                .map(|(n, _)| n.as_str())
                .unwrap_or("");
            let owner = prefixes
                .iter()
                .position(|ps| ps.iter().any(|pre| name.starts_with(pre)));
            last_unit.push(owner.unwrap_or(LOSS));
            post_accumulate::set_hook(p, i)?;
        }
        Ok(Self {
            last_unit: last_unit.into(),
            running: Rc::new(Cell::new((LOSS, LOSS))),
        })
    }

    /// Says that the blocks `first..=last` run their backward next.
    pub(super) fn blocks_running(&self, first: usize, last: usize) {
        self.running.set((first, last));
    }

    /// Says that the loss head runs its backward next.
    pub(super) fn loss_running(&self) {
        self.running.set((LOSS, LOSS));
    }

    /// Runs `f` (a micro-step's loss and backward) with the parameters' hooks stepping `opt`
    /// on each parameter whose gradient is complete, then freeing that gradient. Returns `f`'s
    /// result and the first error a hook met (the engine then stopped the backward).
    pub(super) fn stepping<R>(&self, opt: &mut dyn Optimizer, f: impl FnOnce() -> R) -> (R, Option<String>) {
        let (last_unit, running) = (&self.last_unit, &self.running);
        let mut handler = |i: usize| -> std::result::Result<(), String> {
            let (first, last) = running.get();
            let complete = match last_unit[i] {
                LOSS => first == LOSS,
                b => first != LOSS && (first..=last).contains(&b),
            };
            if !complete {
                return Ok(());
            }
            opt.step_params(&[i]).map_err(|e| e.to_string())?;
            autograd::clear_grad(&opt.params()[i]).map_err(|e| e.to_string())
        };
        post_accumulate::with_handler(&mut handler, f)
    }
}

/// After a step in backward every gradient must have been stepped and freed: the name of a
/// parameter that still has one (a unit other than its owner added to it after the owner's
/// backward, which this runtime cannot step in backward).
pub(super) fn unstepped(chain: &Chain, opt: &dyn Optimizer) -> Option<String> {
    let p = opt.params().iter().find(|p| p.grad().defined())?;
    let named = chain.vs.variables();
    Some(
        named
            .iter()
            .find(|(_, v)| fake::same_tensor(v, p))
            .map_or_else(|| "?".to_owned(), |(n, _)| n.clone()),
    )
}
