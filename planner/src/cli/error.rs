//! Exit codes by error type: 2 for bad input (a flag, a file, a model, a regex the user gave),
//! 1 for work that failed (nothing fits, a run over budget, a libtorch failure). Commands
//! propagate typed errors with context; only [`exit_code`] decides, so every command gives
//! the same code for the same bad input.

use std::process::ExitCode;

use ckptune_models::ModelError;
use ckptune_runtime::RuntimeError;
use ckptune_solver::budget::SizeError;
use ckptune_solver::formats::FormatError;
use ckptune_solver::solver::SolveError;

/// Bad input that no library error type names (a flag's value, a missing file, a
/// combination of flags that cannot work).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Whether one error of a chain says the input was bad.
fn is_bad_input(e: &(dyn std::error::Error + 'static)) -> bool {
    if e.is::<UsageError>() || e.is::<SizeError>() {
        return true;
    }
    if let Some(m) = e.downcast_ref::<ModelError>() {
        // A model that cannot be read or built is the user's file or name; a libtorch call
        // failing while building it is not.
        return !matches!(m, ModelError::Torch { .. });
    }
    if let Some(f) = e.downcast_ref::<FormatError>() {
        // Reading a document the user named; writing an output is the work failing.
        return !matches!(f, FormatError::Write { .. });
    }
    if let Some(r) = e.downcast_ref::<RuntimeError>() {
        return matches!(
            r,
            RuntimeError::Regex { .. }
                | RuntimeError::NotCandidate { .. }
                | RuntimeError::Selection(_)
                | RuntimeError::Config(_)
                // The model has an operator a step on the meta device cannot run.
                | RuntimeError::NotMeasurableOnMeta { .. }
                // A node of the user's program rejects what the step gives it.
                | RuntimeError::Block { .. }
                // A node of the user's program has no derivative or breaks its own backward.
                | RuntimeError::Backward { .. }
                // A selective block's recompute calls what its forward did not.
                | RuntimeError::Selective { .. }
        );
    }
    if let Some(s) = e.downcast_ref::<SolveError>() {
        return matches!(s, SolveError::InvalidBudget { .. });
    }
    // The rest — libtorch failures, a checkpoint regex ckptune itself failed to emit
    // (`RegexError`), solver trouble, writing outputs — is the work failing.
    false
}

/// Whether the error says the input was bad (exit 2), rather than the work failing.
pub fn is_bad_input_error(e: &anyhow::Error) -> bool {
    e.chain().any(is_bad_input)
}

/// The exit code for an error that ended a command.
pub fn exit_code(e: &anyhow::Error) -> ExitCode {
    if is_bad_input_error(e) {
        ExitCode::from(2)
    } else {
        ExitCode::from(1)
    }
}

/// The error as printed: each cause after the context it came with, as `{:#}` prints them, but
/// a cause that the message before it already ends with is not repeated (an error type whose
/// message names its source, such as "cannot read config.json: No such file or directory",
/// would otherwise print the OS's words twice).
pub fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}: {source}")]
    struct Naming {
        path: &'static str,
        source: std::io::Error,
    }

    #[test]
    fn a_cause_the_message_names_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let text = io.to_string();
        let e = anyhow::Error::new(Naming {
            path: "m/config.json",
            source: io,
        })
        .context("loading model m");
        assert_eq!(
            message(&e),
            format!("loading model m: cannot read m/config.json: {text}")
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(message(&plain), "outer: inner");
    }

    #[test]
    fn what_a_step_on_the_meta_device_cannot_run_is_bad_input() {
        let path = std::path::PathBuf::from("m.pt2");
        let errors: [anyhow::Error; 4] = [
            ModelError::TorchScriptOnMeta { path: path.clone() }.into(),
            RuntimeError::NotMeasurableOnMeta {
                why: "aten::glu_backward: no meta kernel".into(),
            }
            .into(),
            ModelError::ExportedOnMeta { path: path.clone() }.into(),
            ModelError::NotMeasurableOnMeta {
                path,
                node: "item".into(),
                target: "torch.ops.aten.item.default".into(),
                why: "depends on tensor values".into(),
                meta_only: false,
            }
            .into(),
        ];
        for e in errors {
            assert!(e.chain().any(is_bad_input), "{e:#}");
        }
    }
}
