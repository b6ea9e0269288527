//! A crate's import graph, one node per source file (module), and its circles.
//!
//! An edge `a → b` means code in `a` names something `b` defines: through a `use`, or a path
//! written out (`crate::hf::load(…)`). A name reached through a re-export (`pub use` in the
//! crate root or a `mod.rs`) counts for the module that defines it, and a re-export alone is
//! no edge: a facade that lists its children's items does not depend on them. A module's
//! `#[cfg(test)]` unit tests are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::source::{code_only, inline_modules, qualified_paths, rust_files, uses, without_test_modules};

/// Module paths (`""` the root, `cli::commands::plan`) and, per module, those it imports.
pub struct Graph {
    pub edges: BTreeMap<String, BTreeSet<String>>,
}

struct Module {
    code: String,
    /// Inline modules (`mod gpu { … }`), where `super::` stays in the file.
    inline: Vec<std::ops::Range<usize>>,
    /// Names it re-exports, each with the absolute path it stands for.
    reexports: BTreeMap<String, Vec<String>>,
}

/// The graph of the crate whose root is `src/lib.rs` (a `main.rs` beside it is another crate).
pub fn graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules: BTreeMap<String, Module> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
            parts.pop();
        }
        if parts == ["main"] {
            continue;
        }
        let code = without_test_modules(&code_only(&std::fs::read_to_string(&f).unwrap()));
        modules.insert(
            parts.join("::"),
            Module {
                inline: inline_modules(&code),
                code,
                reexports: BTreeMap::new(),
            },
        );
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    for (here, m) in modules.iter_mut() {
        for u in uses(&m.code).into_iter().filter(|u| u.public) {
            for path in u.paths {
                let (path, alias) = split_alias(&path);
                if let Some(abs) = absolute(&names, here, &path, m.nesting(u.at)) {
                    let name = alias.unwrap_or_else(|| abs.last().cloned().unwrap_or_default());
                    m.reexports.insert(name, abs);
                }
            }
        }
    }
    let mut edges = BTreeMap::new();
    for (here, m) in &modules {
        let mut to = BTreeSet::new();
        for (path, at) in imported_paths(m) {
            let (path, _) = split_alias(&path);
            if let Some(abs) = absolute(&names, here, &path, m.nesting(at)) {
                let target = defining_module(&modules, &names, &abs, 0);
                if &target != here {
                    to.insert(target);
                }
            }
        }
        edges.insert(here.clone(), to);
    }
    Graph { edges }
}

impl Module {
    /// How many inline modules enclose byte `at`.
    fn nesting(&self, at: usize) -> usize {
        self.inline.iter().filter(|r| r.contains(&at)).count()
    }
}

/// What a module's code imports, each path with its offset: its private `use` paths and
/// written-out paths, and those of its re-exports that its own code also uses by name.
fn imported_paths(m: &Module) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    // The code without declarations: `use` statements and `mod` lines blanked, offsets kept.
    let mut blank: Vec<bool> = vec![false; m.code.len()];
    for u in uses(&m.code) {
        blank[u.at..u.end].iter_mut().for_each(|b| *b = true);
    }
    let mut offset = 0;
    for l in m.code.split_inclusive('\n') {
        let t = l.trim_start();
        if t.starts_with("mod ") || t.contains(" mod ") {
            blank[offset..offset + l.len()].iter_mut().for_each(|b| *b = true);
        }
        offset += l.len();
    }
    let body: String = m
        .code
        .char_indices()
        .map(|(i, c)| if blank[i] && c != '\n' { ' ' } else { c })
        .collect();
    for u in uses(&m.code) {
        for path in u.paths {
            let name = split_alias(&path)
                .1
                .unwrap_or_else(|| path.rsplit("::").next().unwrap().to_string());
            if !u.public || mentions(&body, &name) {
                out.push((path, u.at));
            }
        }
    }
    out.extend(qualified_paths(&body));
    out
}

fn mentions(code: &str, name: &str) -> bool {
    code.match_indices(name).any(|(i, _)| {
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(code[..i].chars().next_back()) && !ident(code[i + name.len()..].chars().next())
    })
}

/// `a::b as c` → (`a::b`, `c`).
fn split_alias(path: &str) -> (String, Option<String>) {
    match path.split_once(" as ") {
        Some((p, a)) => (p.trim().to_string(), Some(a.trim().to_string())),
        None => (path.trim().to_string(), None),
    }
}

/// The absolute segments of `path` written in module `here` inside `nesting` inline modules,
/// or `None` for another crate's.
fn absolute(modules: &BTreeSet<String>, here: &str, path: &str, mut nesting: usize) -> Option<Vec<String>> {
    let mut segs: Vec<String> = path.split("::").map(str::to_string).collect();
    let mut base: Vec<String> = if here.is_empty() {
        Vec::new()
    } else {
        here.split("::").map(str::to_string).collect()
    };
    match segs[0].as_str() {
        "crate" => {
            base.clear();
            segs.remove(0);
        }
        "super" | "self" => {
            while matches!(segs.first().map(String::as_str), Some("super" | "self")) {
                if segs.remove(0) == "super" {
                    // Out of an inline module first: that stays in this file.
                    if nesting > 0 {
                        nesting -= 1;
                    } else {
                        base.pop();
                    }
                }
            }
        }
        // A child of `here` named without `self::` (uniform paths).
        first => {
            let mut child = base.clone();
            child.push(first.to_string());
            if !modules.contains(&child.join("::")) {
                return None;
            }
        }
    }
    base.extend(segs);
    Some(base)
}

/// The module that defines what `abs` names: its longest module prefix, or, when the next
/// segment is an item that module re-exports, the module the re-export leads to.
fn defining_module(
    modules: &BTreeMap<String, Module>,
    names: &BTreeSet<String>,
    abs: &[String],
    depth: usize,
) -> String {
    let mut prefix: Vec<String> = Vec::new();
    let mut i = 0;
    while i < abs.len() && names.contains(&[prefix.clone(), vec![abs[i].clone()]].concat().join("::")) {
        prefix.push(abs[i].clone());
        i += 1;
    }
    let module = prefix.join("::");
    if let (Some(item), true) = (abs.get(i), depth < 8) {
        if let Some(target) = modules[&module].reexports.get(item) {
            let mut next = target.clone();
            next.extend(abs[i + 1..].iter().cloned());
            return defining_module(modules, names, &next, depth + 1);
        }
    }
    module
}

impl Graph {
    /// Every circle: sets of two or more modules that reach each other, each with the edges
    /// inside it, as `a → b` lines.
    pub fn circles(&self) -> Vec<Vec<String>> {
        strongly_connected(&self.edges)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| {
                let mut lines = Vec::new();
                for a in &c {
                    for b in self.edges[a].iter().filter(|b| c.contains(*b)) {
                        lines.push(format!("{} → {}", show(a), show(b)));
                    }
                }
                lines
            })
            .collect()
    }
}

fn show(module: &str) -> &str {
    if module.is_empty() {
        "<crate root>"
    } else {
        module
    }
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}
