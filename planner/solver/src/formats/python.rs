//! Parts of a document written as Python source, for the trainer snippets of `plan --emit`:
//! the plan's checkpoint and config inlined as Python literals, exactly as serde writes them.

use serde::Serialize;

use super::FormatError;

/// `value` as a Python literal: JSON with `True`, `False` and `None` (JSON strings and numbers
/// are valid Python literals as serde_json writes them).
pub fn python_literal<T: Serialize>(value: &T) -> Result<String, FormatError> {
    let v = serde_json::to_value(value).map_err(|e| FormatError::Write {
        path: "a Python snippet".into(),
        source: std::io::Error::other(e),
    })?;
    Ok(literal(&v))
}

fn literal(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(_) | Value::String(_) => v.to_string(),
        Value::Array(items) => format!("[{}]", items.iter().map(literal).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), literal(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_literals() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"a": [true, false, null, 1, 2.5, "x\"y\\z\n"], "b": {}}"#).unwrap();
        assert_eq!(
            python_literal(&v).unwrap(),
            r#"{"a": [True, False, None, 1, 2.5, "x\"y\\z\n"], "b": {}}"#
        );
    }
}
