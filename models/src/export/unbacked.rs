//! Sizes computed from tensor values. A data-dependent operator (`nonzero`, `masked_select`,
//! the index lists of a mixture of experts' routing) gives a tensor whose size torch.export
//! records as an *unbacked* symbol (`u0`, with no hint): no shape alone says what it is. The
//! interpreter runs programs whose sizes follow from the input's and the parameters' shapes, so
//! such a program is refused at load, naming the first node that makes one.

use serde_json::Value as Json;

use super::graph::{GResult, GraphError};

/// Fails on the first node (in program order) with an output tensor of an unbacked size.
pub(super) fn refuse(graph: &Json) -> GResult<()> {
    let values = graph.get("tensor_values");
    let unbacked = |name: &str| {
        values
            .and_then(|v| v.get(name))
            .and_then(|t| t.get("sizes"))
            .and_then(Json::as_array)
            .is_some_and(|sizes| {
                sizes.iter().any(|d| {
                    d.get("as_expr")
                        .is_some_and(|e| e.get("hint").is_none_or(Json::is_null))
                })
            })
    };
    for node in graph.get("nodes").and_then(Json::as_array).into_iter().flatten() {
        let outputs = node.get("outputs").and_then(Json::as_array).into_iter().flatten();
        let names: Vec<&str> = outputs
            .flat_map(|o| match (o.get("as_tensor"), o.get("as_tensors")) {
                (Some(t), _) => vec![t],
                (None, Some(ts)) => ts.as_array().map(|a| a.iter().collect()).unwrap_or_default(),
                (None, None) => Vec::new(),
            })
            .filter_map(|t| t.get("name").and_then(Json::as_str))
            .collect();
        if let Some(name) = names.into_iter().find(|n| unbacked(n)) {
            return Err(GraphError::Unsupported {
                node: node.get("name").and_then(Json::as_str).unwrap_or("?").to_owned(),
                target: node.get("target").and_then(Json::as_str).unwrap_or("?").to_owned(),
                why: format!(
                    "the size of its output {name} depends on tensor values (data-dependent, as \
                     nonzero or masked_select in a mixture of experts' routing), which ckptune's \
                     torch.export interpreter does not run, on the CPU or on the meta device; \
                     export a model whose sizes follow from its input's shape (dense routing), \
                     or profile the model in PyTorch"
                ),
            });
        }
    }
    Ok(())
}
