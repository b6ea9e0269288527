//! Which modules of a program are candidates and how its nodes are cut into blocks: each
//! module's calls, each a contiguous run of nodes (from `nn_module_stack`), the layer rule ([`layers`]) or a
//! `--candidates` regex, candidate runs as blocks and the glue between them as blocks of their
//! own, and at block or nested granularity each layer cut into its children.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::graph::Graph;
use crate::error::{ModelError, Result};
use crate::options::{Granularity, ModelOptions};

/// The blocks a program is cut into, the groups over them (nested granularity: a layer over its
/// children's blocks, `(name, first unit, last unit)`), and every module name in order.
pub(super) struct Cut {
    pub units: Vec<Unit>,
    pub groups: Vec<(String, usize, usize)>,
    pub modules: Vec<String>,
}

/// Cuts `graph` into units by `--candidates` or the granularity; units made only of side nodes
/// are left out (each block computes the side values it reads). A module called several times
/// (ALBERT's shared layer) is one candidate unit per call, each named after the module, so that
/// the plan's choice of the name is what `torch.utils.checkpoint` on the module does: every
/// call checkpointed.
pub(super) fn cut_into_units(path: &Path, graph: &Graph, opts: &ModelOptions, side_nodes: &[bool]) -> Result<Cut> {
    let (modules, runs, split) = module_runs(graph);
    let calls_of = |m: &String| -> Vec<Run> {
        runs.get(m)
            .into_iter()
            .flatten()
            .map(|&(a, b)| (m.clone(), a, b))
            .collect()
    };
    let n = graph.nodes.len();
    let mut units: Vec<Unit>;
    let mut group_units: Vec<(String, usize, usize)> = Vec::new(); // (name, first unit, last unit)
    if let Some(re) = &opts.candidates {
        let re = regex::Regex::new(&format!("^(?:{re})$")).map_err(|e| ModelError::InvalidOption {
            model: path.display().to_string(),
            option: "candidates",
            value: re.clone(),
            why: e.to_string(),
        })?;
        // A module named whose call is not one run cannot be a block; refused unless a module
        // around it is named too (the outer one is the candidate then).
        let named_around = |m: &str| {
            modules
                .iter()
                .any(|o| m.starts_with(&format!("{o}.")) && re.is_match(o))
        };
        let unrunnable: Vec<&String> = (split.iter()).filter(|m| re.is_match(m) && !named_around(m)).collect();
        if let Some(m) = unrunnable.first() {
            return Err(ModelError::InvalidOption {
                model: path.display().to_string(),
                option: "candidates",
                value: re.to_string(),
                why: format!(
                    "it names {m}, a call of which is not one contiguous run of nodes in the program \
                     (other nodes run between its own), so it cannot be checkpointed as a block{}; \
                     name its parent module or its children instead",
                    if unrunnable.len() > 1 {
                        format!(" ({} such modules)", unrunnable.len())
                    } else {
                        String::new()
                    }
                ),
            });
        }
        let chosen: Vec<_> = modules.iter().filter(|m| re.is_match(m)).flat_map(calls_of).collect();
        if chosen.is_empty() {
            return Err(ModelError::InvalidOption {
                model: path.display().to_string(),
                option: "candidates",
                value: re.to_string(),
                why: "no module each of whose calls forms one contiguous run of nodes matches it".into(),
            });
        }
        units = cut(graph, 0, n - 1, &whole_calls(disjoint(chosen), &runs), 0);
    } else {
        // A layer called several times is offered when its calls follow each other (ALBERT's
        // shared layer group); one called at places apart (a shared activation) is offered only
        // by name (`--candidates`), as the glue around its calls may then hand on several tensors.
        let in_a_row = |m: &&String| runs.get(*m).is_some_and(|c| c.windows(2).all(|w| w[1].0 == w[0].1 + 1));
        let layer_runs: Vec<_> = layers(&modules, &runs)
            .iter()
            .filter(in_a_row)
            .flat_map(calls_of)
            .collect();
        let layer_runs = whole_calls(disjoint(layer_runs), &runs);
        match opts.granularity {
            Granularity::Layer => units = cut(graph, 0, n - 1, &layer_runs, 0),
            Granularity::Block | Granularity::Nested => {
                units = Vec::new();
                let outer = cut(graph, 0, n - 1, &layer_runs, 0);
                let inner_runs = whole_calls(disjoint(children_runs(&outer, &modules, calls_of)), &runs);
                for u in outer {
                    // A layer called several times stays whole at nested granularity: its
                    // calls would be groups of one name, which the runtime's groups are not.
                    let shared = runs.get(&u.name).is_some_and(|c| c.len() > 1);
                    if !u.candidate || (shared && opts.granularity == Granularity::Nested) {
                        units.push(u);
                        continue;
                    }
                    let depth = u.name.split('.').count();
                    let inner = cut(graph, u.first, u.last, &inner_runs, depth);
                    // A layer of one child is not a group (a group spans two blocks or more):
                    // its child is the candidate, as in the built-in models.
                    let nested = opts.granularity == Granularity::Nested && inner.len() >= 2;
                    if inner.iter().any(|i| i.candidate) {
                        if nested {
                            group_units.push((u.name.clone(), units.len(), units.len() + inner.len() - 1));
                        }
                        units.extend(inner);
                    } else {
                        units.push(u);
                    }
                }
            }
        }
    }

    units.retain(|u| (u.first..=u.last).any(|k| !side_nodes[k]));
    let units = fold_tensor_free(units, &mut group_units, graph, side_nodes);
    Ok(Cut {
        units,
        groups: group_units,
        modules,
    })
}

/// A candidate module's call: its name and node range.
type Run = (String, usize, usize);

/// Per module, the node range of each of its calls, in program order.
type Calls = HashMap<String, Vec<(usize, usize)>>;

/// The calls of the candidate layers' children inside each layer call, each child called once
/// per call of its layer (ALBERT's shared layer's children, once per call of it); a child called
/// twice within one call (torchvision BasicBlock's `relu`) is left to the glue, as the built-in
/// models have it.
fn children_runs(outer: &[Unit], modules: &[String], calls_of: impl Fn(&String) -> Vec<Run>) -> Vec<Run> {
    let mut out = Vec::new();
    for u in outer.iter().filter(|u| u.candidate) {
        let kids: Vec<Run> = (children(&u.name, modules).into_iter().flat_map(&calls_of))
            .filter(|(_, a, b)| *a >= u.first && *b <= u.last)
            .collect();
        out.extend(
            (kids.iter())
                .filter(|(m, _, _)| kids.iter().filter(|k| &k.0 == m).count() == 1)
                .cloned(),
        );
    }
    out
}

/// `runs` less the modules some of whose calls are not among them (a call inside a longer
/// candidate run): a plan that checkpoints a module checkpoints every call of it, so either
/// every call is a unit of its own or none is.
fn whole_calls(runs: Vec<Run>, all: &Calls) -> Vec<Run> {
    let kept = |m: &str| runs.iter().filter(|(r, _, _)| r == m).count();
    let whole: Vec<bool> = runs
        .iter()
        .map(|(m, _, _)| all.get(m).is_some_and(|c| c.len() == kept(m)))
        .collect();
    runs.into_iter()
        .zip(whole)
        .filter(|(_, w)| *w)
        .map(|(r, _)| r)
        .collect()
}

/// Folds each unit whose nodes make no tensor into a neighbour: a symbolic size alone
/// (`sym_size(x, 0)`, which torch.export hoists ahead of the first layer when the batch is
/// dynamic and a layer reads it, as torchvision's stochastic depth does) would be a block that
/// hands nothing on. Its values are symbolic, shared by every block (`Program::syms`) once
/// computed, so it runs with the unit before it, or with the one after it where it is the first
/// unit or starts a group (the group keeps its own units). `groups` are remapped.
fn fold_tensor_free(
    units: Vec<Unit>,
    groups: &mut [(String, usize, usize)],
    g: &Graph,
    side_nodes: &[bool],
) -> Vec<Unit> {
    let makes_tensor =
        |u: &Unit| (u.first..=u.last).any(|k| !side_nodes[k] && g.nodes[k].defines().iter().any(|&v| g.is_tensor[v]));
    let n = units.len();
    let mut out: Vec<Unit> = Vec::with_capacity(n);
    // Old unit index -> new; units folded forward take the index of the unit they join.
    let mut index = vec![0usize; n];
    let mut forward: Vec<usize> = Vec::new();
    let mut carried: Option<usize> = None;
    for (i, mut u) in units.into_iter().enumerate() {
        if !makes_tensor(&u) {
            let starts_group = groups.iter().any(|grp| grp.1 == i);
            match out.last_mut() {
                Some(prev) if !(starts_group && i + 1 < n) => {
                    prev.last = u.last;
                    index[i] = out.len() - 1;
                    continue;
                }
                _ if i + 1 < n => {
                    carried.get_or_insert(u.first);
                    forward.push(i);
                    continue;
                }
                // A lone unit that makes no tensor: left for the dataflow to report.
                _ => {}
            }
        }
        if let Some(first) = carried.take() {
            u.first = first;
        }
        for f in forward.drain(..) {
            index[f] = out.len();
        }
        index[i] = out.len();
        out.push(u);
    }
    for grp in groups.iter_mut() {
        grp.1 = index.get(grp.1).copied().unwrap_or(grp.1);
        grp.2 = index.get(grp.2).copied().unwrap_or(grp.2);
    }
    out
}

/// Every module in order; the node range of each call (told apart by the stack key torch.export
/// gives each call) of the modules each of whose calls is one contiguous run of nodes; the
/// modules with a call that is not.
pub(super) fn module_runs(g: &Graph) -> (Vec<String>, Calls, Vec<String>) {
    let mut order: Vec<String> = Vec::new();
    let mut known: HashSet<String> = HashSet::new();
    // Per call, in order of its first node: (module, first node, last node, nodes).
    let mut calls: Vec<(String, usize, usize, usize)> = Vec::new();
    let mut call_of: HashMap<&str, usize> = HashMap::new();
    for (k, n) in g.nodes.iter().enumerate() {
        for (m, key) in n.modules.iter().zip(&n.calls) {
            if known.insert(m.clone()) {
                // Containers whose forward never runs (a ModuleList such as BERT's
                // `encoder.layer`) appear only as prefixes; they are modules all the same.
                let mut missing: Vec<String> = Vec::new();
                let mut a = parent(m);
                while !a.is_empty() && known.insert(a.to_owned()) {
                    missing.push(a.to_owned());
                    a = parent(a);
                }
                order.extend(missing.into_iter().rev());
                order.push(m.clone());
            }
            let c = *call_of.entry(key.as_str()).or_insert_with(|| {
                calls.push((m.clone(), k, k, 0));
                calls.len() - 1
            });
            calls[c].2 = k;
            calls[c].3 += 1;
        }
    }
    let broken: HashSet<&String> = calls.iter().filter(|c| c.2 - c.1 + 1 != c.3).map(|c| &c.0).collect();
    let mut runs: Calls = HashMap::new();
    for (m, a, b, _) in calls.iter().filter(|c| !broken.contains(&c.0)) {
        runs.entry(m.clone()).or_default().push((*a, *b));
    }
    let split = order.iter().filter(|m| broken.contains(m)).cloned().collect();
    (order, runs, split)
}

fn parent(m: &str) -> &str {
    m.rfind('.').map_or("", |i| &m[..i])
}

pub(super) fn children<'a>(m: &str, modules: &'a [String]) -> Vec<&'a String> {
    modules
        .iter()
        .filter(|c| parent(c) == m && !c.is_empty() && c.as_str() != m)
        .collect()
}

/// The repeated layers of a model, by this rule: a *layer container* is a module with children
/// whose names end in a number (`layer1.0`, `encoder.layer.3`, `model.layers.7`,
/// `encoder.layers.encoder_layer_5`), taking those that neither are nor lie inside another
/// container's numbered child (Whisper's `encoder.layers` is one, beside its numbered
/// `encoder.conv1` and `conv2`). If two or more containers whose
/// own names end in a number are siblings (torchvision ResNet's `layer1` … `layer4`) they are the
/// layers, as ckptune's built-in ResNets have it. Otherwise the numbered children of the
/// container whose numbered children run the most nodes are (BERT's `encoder.layer.N`, Llama's
/// `model.layers.N`, ViT's `encoder.layers.encoder_layer_N` rather than its `heads.0`,
/// MobileNet's and EfficientNet's `features.N` rather than `features` and `classifier`, MaxViT's
/// four `blocks.N` rather than its six-entry `classifier` head), and so are those of every other
/// container whose numbered children are all modules of modules, as layers are and a head's
/// single operators are not (a dense block's layers after MobileNet-style stages, a speech
/// model's convolutional feature encoder before its transformer layers, an encoder's and a
/// decoder's stacks). Nodes, not children, because a head's Sequential may list more modules
/// than the body has stages. Without any container the top-level modules are. Only modules each
/// of whose calls is one contiguous run of nodes qualify.
pub fn layers(modules: &[String], runs: &HashMap<String, Vec<(usize, usize)>>) -> Vec<String> {
    let numbered = |c: &str| {
        c.rsplit('.')
            .next()
            .is_some_and(|s| s.ends_with(|ch: char| ch.is_ascii_digit()))
    };
    let mut containers: Vec<&String> = modules
        .iter()
        .filter(|m| children(m, modules).iter().any(|c| numbered(c)))
        .collect();
    // A container that is another's numbered child, or lies inside one (a ResNet block's
    // `downsample`), is part of that layer; one beside another's numbered children (Whisper's
    // `encoder.layers` beside `encoder.conv1` and `conv2`) is not.
    containers.retain(|c| {
        !modules
            .iter()
            .any(|x| numbered(x) && !parent(x).is_empty() && (c == &x || c.starts_with(&format!("{x}."))))
    });
    // Sibling layers: numbered containers (`layer1`, `layer2`) sharing a parent.
    let mut by_parent: HashMap<&str, usize> = HashMap::new();
    for c in containers.iter().filter(|c| numbered(c)) {
        *by_parent.entry(parent(c)).or_default() += 1;
    }
    let siblings = |c: &str| numbered(c) && by_parent.get(parent(c)).is_some_and(|&n| n >= 2);
    let numbered_children = |c: &str| children(c, modules).into_iter().filter(|x| numbered(x));
    // The nodes a container's numbered children run, every call counted.
    let coverage = |c: &str| -> usize {
        numbered_children(c)
            .flat_map(|x| runs.get(x).into_iter().flatten())
            .map(|&(a, b)| b + 1 - a)
            .sum()
    };
    // Among lone containers, the one(s) whose numbered children run the most nodes hold the
    // layers (a ViT's `encoder.layers`, not its one-entry `heads` Sequential).
    let most = containers
        .iter()
        .filter(|c| !siblings(c))
        .map(|c| coverage(c))
        .max()
        .unwrap_or(0);
    // Whether every numbered child of `c` has children of its own in the program.
    let stacks_layers = |c: &str| numbered_children(c).all(|x| !children(x, modules).is_empty());
    let mut out: Vec<String> = Vec::new();
    for c in &containers {
        if siblings(c) {
            out.push((*c).clone());
        } else if coverage(c) == most || stacks_layers(c) {
            out.extend(numbered_children(c).cloned());
        }
    }
    if out.is_empty() {
        out = children("", modules).into_iter().cloned().collect();
    }
    out.retain(|m| runs.contains_key(m));
    out
}

/// A chain unit before it becomes a block: node range, name, whether it is a candidate.
pub(super) struct Unit {
    pub name: String,
    pub first: usize,
    pub last: usize,
    pub candidate: bool,
}

/// Cuts nodes `lo..=hi` into units: the given (disjoint, sorted) candidate runs inside it and the
/// glue between them, named after the modules its nodes belong to (`conv1+bn1+relu+maxpool`).
pub(super) fn cut(g: &Graph, lo: usize, hi: usize, cands: &[(String, usize, usize)], depth: usize) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut k = lo;
    let glue = |a: usize, b: usize| -> Unit {
        let mut names: Vec<String> = Vec::new();
        for n in &g.nodes[a..=b] {
            if let Some(m) = n.modules.get(depth) {
                if !names.contains(m) {
                    names.push(m.clone());
                }
            }
        }
        let name = if names.is_empty() {
            // Nodes of the enclosing module itself (a layer's residual sums): named after it.
            match g.nodes[a].modules.last() {
                Some(m) => format!("{m} ({})", g.nodes[a].name),
                None => format!("<{}>", g.nodes[a].name),
            }
        } else {
            names.join("+")
        };
        Unit {
            name,
            first: a,
            last: b,
            candidate: false,
        }
    };
    for (m, a, b) in cands.iter().filter(|(_, a, b)| *a >= lo && *b <= hi) {
        if *a > k {
            units.push(glue(k, a - 1));
        }
        units.push(Unit {
            name: m.clone(),
            first: *a,
            last: *b,
            candidate: true,
        });
        k = b + 1;
    }
    if k <= hi {
        units.push(glue(k, hi));
    }
    units
}

pub(super) fn disjoint(mut cands: Vec<(String, usize, usize)>) -> Vec<(String, usize, usize)> {
    // Outermost first where runs nest: longer runs win, then order by position.
    cands.sort_by_key(|(_, a, b)| (*a, std::cmp::Reverse(*b)));
    let mut out: Vec<(String, usize, usize)> = Vec::new();
    for c in cands {
        if out.last().is_none_or(|l| c.1 > l.2) {
            out.push(c);
        }
    }
    out
}
