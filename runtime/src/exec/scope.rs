//! The user scopes a step opens around each part of its work ([`Scope`]), so that an
//! operator trace, or the PyTorch profiler, says which block and phase every operator was part
//! of: `ckptune::forward#3:encoder.layer.0`, `ckptune::recompute#3:…`, `ckptune::backward#3:…`
//! (a fused group's one VJP is its last block's), `ckptune::loss`, `ckptune::optimizer`.
//! What runs outside them (the batch, the attention mask) is the step's own.

use ckptune_kernels::optrace::Scope;

use crate::error::Result;

/// What part of a step a scope covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// A block's forward (under no-grad when the block is checkpointed).
    Forward,
    /// A checkpointed block's recompute in backward.
    Recompute,
    /// A block's VJP (a fused group's, on its last block).
    Backward,
    /// The loss head's forward and backward.
    Loss,
    /// The optimizer step and `zero_grad`.
    Optimizer,
}

impl Phase {
    fn word(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Recompute => "recompute",
            Phase::Backward => "backward",
            Phase::Loss => "loss",
            Phase::Optimizer => "optimizer",
        }
    }
}

const PREFIX: &str = "ckptune::";

/// Opens the scope of `phase` (of block `block`, index and name, for the block phases).
pub(crate) fn open(phase: Phase, block: Option<(usize, &str)>) -> Result<Scope> {
    let name = match block {
        Some((i, n)) => format!("{PREFIX}{}#{i}:{n}", phase.word()),
        None => format!("{PREFIX}{}", phase.word()),
    };
    Ok(Scope::enter(&name)?)
}

/// The phase and block index of a scope's name, as [`open`] names it; `None` for a scope
/// ckptune did not open.
pub fn parse(name: &str) -> Option<(Phase, Option<usize>)> {
    let rest = name.strip_prefix(PREFIX)?;
    let (word, block) = match rest.split_once('#') {
        Some((w, b)) => (w, Some(b.split(':').next()?.parse().ok()?)),
        None => (rest, None),
    };
    let phase = [
        Phase::Forward,
        Phase::Recompute,
        Phase::Backward,
        Phase::Loss,
        Phase::Optimizer,
    ]
    .into_iter()
    .find(|p| p.word() == word)?;
    (block.is_some() == matches!(phase, Phase::Forward | Phase::Recompute | Phase::Backward)).then_some((phase, block))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        assert_eq!(
            parse("ckptune::forward#3:encoder.layer.0"),
            Some((Phase::Forward, Some(3)))
        );
        assert_eq!(parse("ckptune::backward#12:h.1.mlp"), Some((Phase::Backward, Some(12))));
        assert_eq!(parse("ckptune::loss"), Some((Phase::Loss, None)));
        assert_eq!(parse("ckptune::optimizer"), Some((Phase::Optimizer, None)));
        assert_eq!(parse("ckptune::loss#1:x"), None);
        assert_eq!(parse("ckptune::forward"), None);
        assert_eq!(parse("my_scope"), None);
    }
}
