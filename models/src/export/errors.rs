//! A graph's errors as the models crate reports them: the file, and the node with its
//! operator where one is at fault.

use std::path::Path;

use super::graph::GraphError;
use crate::error::ModelError;

pub(super) fn graph_err(path: &Path) -> impl Fn(GraphError) -> ModelError + '_ {
    move |e| match e {
        GraphError::Format(reason) => ModelError::BadExport {
            path: path.to_path_buf(),
            reason,
        },
        GraphError::Unsupported { node, target, why } => ModelError::ExportNode {
            path: path.to_path_buf(),
            node,
            target,
            why,
        },
    }
}
