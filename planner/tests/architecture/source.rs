//! Reading Rust sources the way the architecture checks need: code without comments and
//! literals, `use` trees expanded, functions with their lengths. Plain text work, enough for
//! this workspace's style (rustfmt-formatted, one item per line start); it is not a parser.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, skipping build outputs and hidden folders.
pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// `text` with comments removed and string and char literals emptied, line breaks kept, so
/// that what is left is code and line numbers still match.
pub fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                if chars[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
        } else if c == 'r' && (next == Some('"') || (next == Some('#') && !is_ident(chars.get(i.wrapping_sub(1))))) {
            i = skip_raw_string(&chars, i, &mut out);
        } else if c == '"' {
            out.push_str("\"\"");
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if chars.get(i) == Some(&'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' && is_char_literal(&chars, i) {
            out.push_str("' '");
            i += if next == Some('\\') { 2 } else { 1 };
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn is_ident(c: Option<&char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || *c == '_')
}

/// `r"…"` or `r#"…"#` starting at `i`: skipped, its line breaks kept; returns the index after it.
fn skip_raw_string(chars: &[char], mut i: usize, out: &mut String) -> usize {
    i += 1;
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    if chars.get(i) != Some(&'"') {
        // `r#ident`, not a string.
        out.push('r');
        return i - hashes;
    }
    i += 1;
    out.push_str("\"\"");
    loop {
        match chars.get(i) {
            None => return i,
            Some('"') if (0..hashes).all(|k| chars.get(i + 1 + k) == Some(&'#')) => return i + 1 + hashes,
            Some('\n') => out.push('\n'),
            _ => {}
        }
        i += 1;
    }
}

/// Whether the `'` at `i` opens a char literal (`'a'`, `'\n'`) rather than a lifetime (`'a`).
fn is_char_literal(chars: &[char], i: usize) -> bool {
    match chars.get(i + 1) {
        Some('\\') => true,
        Some(_) => chars.get(i + 2) == Some(&'\''),
        None => false,
    }
}

/// `code` without its `#[cfg(test)]` modules: unit tests sit inside the module they test and
/// may reach anywhere, which says nothing about the module's own imports.
pub fn without_test_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let Some(open) = after.find('{') else {
            rest = "";
            break;
        };
        let end = matching_brace(after, open).unwrap_or(after.len() - 1);
        out.extend(after[..=end].chars().filter(|&c| c == '\n'));
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The byte ranges of the inline modules (`mod gpu { … }`) of `code`: inside one, `super::`
/// names the file's own module.
pub fn inline_modules(code: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("mod ") {
        if i > 0
            && code[..i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &code[i + 4..];
        let name_len = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if name_len == 0 || !rest[name_len..].trim_start().starts_with('{') {
            continue;
        }
        let open = i + 4 + name_len + rest[name_len..].find('{').unwrap();
        if let Some(close) = matching_brace(code, open) {
            out.push(open..close);
        }
    }
    out
}

/// The index of the `}` closing the `{` at `open`.
fn matching_brace(text: &str, open: usize) -> Option<usize> {
    let mut depth = 0i64;
    for (i, c) in text.char_indices().skip_while(|&(i, _)| i < open) {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// One `use` declaration: the paths its tree names, whether it is a re-export, and where it
/// stands (from its `use` to its `;`, byte offsets).
pub struct Use {
    pub paths: Vec<String>,
    pub public: bool,
    pub at: usize,
    pub end: usize,
}

/// The `use` declarations of `code` (already [`code_only`]).
pub fn uses(code: &str) -> Vec<Use> {
    let mut out = Vec::new();
    let mut offset = 0;
    for statement in code.split_inclusive(';') {
        let start = offset;
        offset += statement.len();
        let Some(at) = find_word(statement, "use") else {
            continue;
        };
        let before = statement[..at].trim_end();
        // Only a statement that starts with `use` (after attributes and a visibility).
        let head = before.rsplit(['\n', '}', '{', ']']).next().unwrap_or("").trim();
        if !(head.is_empty() || head.starts_with("pub")) {
            continue;
        }
        let tree = statement[at + 3..].trim_end_matches(';');
        out.push(Use {
            paths: expand_tree(tree),
            public: head.starts_with("pub"),
            at: start + at,
            end: start + statement.len(),
        });
    }
    out
}

/// The byte index of `word` standing alone in `text`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    text.match_indices(word).map(|(i, _)| i).find(|&i| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !is_ident(before.as_ref()) && !is_ident(after.as_ref())
    })
}

/// `a::{b, c::{d, e as f}}` → `a::b`, `a::c::d`, `a::c::e as f`.
pub fn expand_tree(tree: &str) -> Vec<String> {
    let tree: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    expand_into("", tree.trim(), &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let mut depth = 0;
    let mut start = 0;
    let bytes: Vec<char> = tree.chars().collect();
    let mut items = Vec::new();
    for (i, &c) in bytes.iter().enumerate() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(bytes[start..i].iter().collect::<String>());
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(bytes[start..].iter().collect());
    for item in items {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        match item.find("::{") {
            Some(k) if item.ends_with('}') => {
                let inner = &item[k + 3..item.len() - 1];
                expand_into(&format!("{prefix}{}::", &item[..k]), inner, out);
            }
            _ if item.starts_with('{') && item.ends_with('}') => expand_into(prefix, &item[1..item.len() - 1], out),
            _ => out.push(format!("{prefix}{item}")),
        }
    }
}

/// Paths written out in code (`crate::hf::load(...)`, `super::exec::Session`), outside `use`,
/// each with its byte offset.
pub fn qualified_paths(code: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for start in ["crate::", "super::", "self::"] {
        for (i, _) in code.match_indices(start) {
            let before = code[..i].chars().next_back();
            if is_ident(before.as_ref()) || before == Some(':') {
                continue;
            }
            let len = code[i..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(code.len() - i);
            out.push((code[i..i + len].trim_end_matches(':').to_string(), i));
        }
    }
    out
}

/// A function of a source file: its name, first line (1-based) and length in lines, and
/// whether a comment right above it says why it stays whole.
pub struct Function {
    pub name: String,
    pub line: usize,
    pub lines: usize,
    pub kept_whole: bool,
}

/// The functions of `text` (a whole source file), nested ones included.
pub fn functions(text: &str) -> Vec<Function> {
    let raw: Vec<&str> = text.lines().collect();
    let code = code_only(text);
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        let mut depth = 0i64;
        let mut opened = false;
        let mut end = None;
        for (j, l) in lines.iter().enumerate().skip(i) {
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened && depth == 0 => end = Some(j),
                    _ => {}
                }
                if opened && depth == 0 && end.is_none() {
                    end = Some(j);
                }
            }
            if end.is_some() {
                break;
            }
        }
        if !opened {
            continue;
        }
        let end = end.unwrap_or(lines.len() - 1);
        let kept_whole = raw[..i]
            .iter()
            .rev()
            .take_while(|l| {
                let t = l.trim_start();
                t.starts_with("//") || t.starts_with("#[")
            })
            .any(|l| l.contains("stays whole"));
        out.push(Function {
            name,
            line: i + 1,
            lines: end - i + 1,
            kept_whole,
        });
    }
    out
}

/// The name of the function `line` declares, if it declares one.
fn fn_name(line: &str) -> Option<String> {
    let at = find_word(line, "fn")?;
    let head = line[..at].trim();
    let qualifiers = ["pub", "pub(crate)", "pub(super)", "const", "async", "unsafe", "extern"];
    if !head
        .split_whitespace()
        .all(|w| qualifiers.contains(&w) || w.starts_with("pub(") || w == "\"\"")
    {
        return None;
    }
    let rest = line[at + 2..].trim_start();
    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}
