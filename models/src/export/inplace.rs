//! Which values a node writes in place, read from its operator's schema: an argument whose type
//! carries a write annotation (`aten::relu_(Tensor(a!) self)`) is written, as the dispatcher's
//! alias analysis reads it, whatever the operator is called.

use ckptune_kernels::ops;

use super::graph::{Input, Node, Target};

/// The tensor values `node` writes in place (none for an operator without a written argument,
/// or for a node that is no operator call).
pub(super) fn written(node: &Node) -> Vec<usize> {
    let Target::Op { name, overload } = &node.target else {
        return Vec::new();
    };
    // The load-time check of every operator found its schema; one that is missing writes nothing
    // as far as this is concerned.
    let Ok(schema) = ops::schema(name, overload) else {
        return Vec::new();
    };
    let names = written_args(&schema);
    node.args
        .iter()
        .filter(|(a, _)| names.iter().any(|n| n == a))
        .flat_map(|(_, i)| match i {
            Input::Tensor(v) => vec![*v],
            Input::Tensors(vs) => vs.iter().flatten().copied().collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// The names of the arguments a schema marks as written (`Tensor(a!) self`, `Tensor(a!)[] out`).
fn written_args(schema: &str) -> Vec<String> {
    let Some(open) = schema.find('(') else {
        return Vec::new();
    };
    let close = schema.rfind(") ->").unwrap_or(schema.len());
    let Some(args) = schema.get(open + 1..close) else {
        return Vec::new();
    };
    split_top_level(args)
        .into_iter()
        .filter_map(|arg| {
            // `Tensor(a!) self`, `int[2] stride=[1, 1]`: the declaration before any default.
            let decl = arg.split('=').next().unwrap_or("").trim();
            let (ty, name) = decl.rsplit_once(' ')?;
            ty.contains('!').then(|| name.to_owned())
        })
        .collect()
}

/// `args` split at the commas outside brackets and parentheses.
fn split_top_level(args: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in args.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&args[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&args[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::written_args;

    #[test]
    fn written_arguments_come_from_the_annotation() {
        assert_eq!(written_args("aten::relu_(Tensor(a!) self) -> Tensor(a!)"), ["self"]);
        assert_eq!(
            written_args("aten::add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)"),
            ["self"]
        );
        assert!(written_args(
            "aten::conv2d(Tensor input, Tensor weight, Tensor? bias=None, SymInt[2] stride=[1, 1]) -> Tensor"
        )
        .is_empty());
        assert_eq!(
            written_args("aten::add.out(Tensor self, Tensor other, *, Scalar alpha=1, Tensor(a!) out) -> Tensor(a!)"),
            ["out"]
        );
    }
}
