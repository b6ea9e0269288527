//! Filling a snippet template (`templates/*.py`): each `${name}` is replaced by its value and
//! nothing else is interpreted, so a template reads as the Python it produces.

/// A template from `templates/`, with the values of its placeholders.
pub(super) struct Template {
    text: &'static str,
    values: Vec<(&'static str, String)>,
}

impl Template {
    pub(super) fn new(text: &'static str) -> Self {
        Template {
            text,
            values: Vec::new(),
        }
    }

    /// Sets `${name}`.
    pub(super) fn set(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.values.push((name, value.into()));
        self
    }

    /// The filled text. Every placeholder must have a value and every value a placeholder;
    /// the snapshot tests (`planner/tests/snippets.rs`) fill every template, so a mismatch is a
    /// bug they catch before it ships.
    pub(super) fn fill(self) -> String {
        let mut out = String::with_capacity(self.text.len() + self.values.iter().map(|(_, v)| v.len()).sum::<usize>());
        let mut used = vec![false; self.values.len()];
        let mut rest = self.text;
        while let Some(at) = rest.find("${") {
            out.push_str(&rest[..at]);
            let end = at + rest[at..].find('}').expect("a template placeholder is closed");
            let name = &rest[at + 2..end];
            let k = self
                .values
                .iter()
                .position(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("template placeholder ${{{name}}} has no value"));
            used[k] = true;
            out.push_str(&self.values[k].1);
            rest = &rest[end + 1..];
        }
        out.push_str(rest);
        let unused: Vec<&str> = self
            .values
            .iter()
            .zip(&used)
            .filter(|(_, u)| !**u)
            .map(|((n, _), _)| *n)
            .collect();
        assert!(unused.is_empty(), "template values without a placeholder: {unused:?}");
        out
    }

    /// [`Template::fill`] for a part placed inside another template: without the final line
    /// break every template file ends with (the outer template has its own).
    pub(super) fn fill_part(self) -> String {
        let mut s = self.fill();
        if s.ends_with('\n') {
            s.pop();
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_replaced_and_nothing_else() {
        let t = Template::new("a = ${x}\nb = {x} ${y}${y}\n")
            .set("x", "1")
            .set("y", "f\"{z}\"");
        assert_eq!(t.fill(), "a = 1\nb = {x} f\"{z}\"f\"{z}\"\n");
        assert_eq!(Template::new("${x}\n").set("x", "1").fill_part(), "1");
    }

    #[test]
    #[should_panic(expected = "has no value")]
    fn a_placeholder_without_a_value_is_a_bug() {
        Template::new("${missing}").fill();
    }

    #[test]
    #[should_panic(expected = "without a placeholder")]
    fn a_value_without_a_placeholder_is_a_bug() {
        Template::new("text").set("x", "1").fill();
    }
}
