//! The graph of a `torch.export` program as `models/model.json` writes it (schema of
//! `torch/_export/serde/schema.py`, major version 8), parsed into nodes that reference values by
//! index. [`super::interpret`] runs it.

use std::collections::HashMap;

use ckptune_kernels::ops;
use serde_json::Value as Json;

/// Why a graph cannot be read or run; turned into [`crate::ModelError`] by the caller.
#[derive(Debug)]
pub(crate) enum GraphError {
    /// The JSON does not have the shape the serializer writes.
    Format(String),
    /// A node whose operator cannot be run: `(node, target, why)`.
    Unsupported { node: String, target: String, why: String },
}

pub(crate) type GResult<T> = std::result::Result<T, GraphError>;

fn format_err(what: impl Into<String>) -> GraphError {
    GraphError::Format(what.into())
}

/// A Python scalar operator on symbolic sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PyOp {
    Add,
    Sub,
    Mul,
    FloorDiv,
    TrueDiv,
    Mod,
    Neg,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug)]
pub(crate) enum Target {
    /// `torch.ops.<ns>.<op>.<overload>`: `("<ns>::<op>", overload or "" for `default`)`.
    Op {
        name: String,
        overload: String,
    },
    Python(PyOp),
    GetItem,
    /// `torch.ops.higher_order.wrap_with_set_grad_enabled(enabled, graph, *operands)`.
    SetGrad,
    /// `torch.ops.higher_order.wrap_with_autocast(device_type, dtype, enabled, cache_enabled,
    /// graph, *operands)`: a `with torch.autocast(...)` block inside forward (transformers'
    /// rotary embedding turns autocast off around its cos/sin).
    Autocast,
}

#[derive(Debug, Clone)]
pub(crate) enum SymOrInt {
    Sym(usize),
    Int(i64),
}

#[derive(Debug)]
pub(crate) enum Input {
    None,
    Tensor(usize),
    Tensors(Vec<Option<usize>>),
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Bools(Vec<bool>),
    Str(String),
    Sym(usize),
    SymInts(Vec<SymOrInt>),
    /// A subgraph (index into [`Graph::subgraphs`]).
    Graph(usize),
}

impl Input {
    /// The values this argument reads.
    pub(crate) fn reads(&self) -> Vec<usize> {
        match self {
            Input::Tensor(v) | Input::Sym(v) => vec![*v],
            Input::Tensors(vs) => vs.iter().flatten().copied().collect(),
            Input::SymInts(vs) => vs
                .iter()
                .filter_map(|s| match s {
                    SymOrInt::Sym(v) => Some(*v),
                    SymOrInt::Int(_) => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

#[derive(Debug)]
pub(crate) enum Output {
    None,
    Tensor(usize),
    Tensors(Vec<usize>),
    Sym(usize),
}

impl Output {
    fn defines(&self) -> Vec<usize> {
        match self {
            Output::Tensor(v) | Output::Sym(v) => vec![*v],
            Output::Tensors(vs) => vs.clone(),
            Output::None => Vec::new(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Node {
    pub name: String,
    /// As the program writes it (`torch.ops.aten.conv2d.default`), for messages.
    pub target_text: String,
    pub target: Target,
    pub args: Vec<(String, Input)>,
    pub outputs: Vec<Output>,
    /// Qualified names of the modules whose forward ran this node, outermost first, the root
    /// excluded (`["layer1", "layer1.0", "layer1.0.conv1"]`).
    pub modules: Vec<String>,
    /// Per entry of `modules`, which call of that module ran the node: torch.export's stack
    /// key, distinct per call (`L__self__layer`, then `L__self__layer@1` for its second call).
    pub calls: Vec<String>,
}

impl Node {
    pub fn reads(&self) -> Vec<usize> {
        self.args.iter().flat_map(|(_, a)| a.reads()).collect()
    }
    pub fn defines(&self) -> Vec<usize> {
        self.outputs.iter().flat_map(Output::defines).collect()
    }
}

/// One graph: values by index (`names`), its placeholders and outputs, and its nodes.
#[derive(Debug)]
pub(crate) struct Graph {
    pub names: Vec<String>,
    /// Whether each value is a tensor (else a symbolic int).
    pub is_tensor: Vec<bool>,
    pub inputs: Vec<usize>,
    pub outputs: Vec<Input>,
    pub nodes: Vec<Node>,
    pub subgraphs: Vec<Graph>,
    /// Per value: the index of the last node that reads it (`nodes.len()` for graph outputs).
    pub last_use: Vec<Option<usize>>,
}

struct Ids<'a> {
    map: HashMap<String, usize>,
    graph: &'a mut Graph,
}

impl Ids<'_> {
    fn id(&mut self, name: &str, tensor: bool) -> usize {
        if let Some(&i) = self.map.get(name) {
            return i;
        }
        let i = self.graph.names.len();
        self.graph.names.push(name.to_owned());
        self.graph.is_tensor.push(tensor);
        self.map.insert(name.to_owned(), i);
        i
    }
}

fn name_of(j: &Json) -> GResult<&str> {
    j.get("name")
        .or_else(|| j.get("as_name"))
        .and_then(Json::as_str)
        .ok_or_else(|| format_err(format!("expected a named value, found {j}")))
}

/// Maps the serializer's `ScalarType` / `Layout` / `MemoryFormat` enums to c10's numbering.
fn c10_scalar_type(serde: i64) -> Option<i64> {
    Some(match serde {
        1 => 0,   // Byte
        2 => 1,   // Char
        3 => 2,   // Short
        4 => 3,   // Int
        5 => 4,   // Long
        6 => 5,   // Half
        7 => 6,   // Float
        8 => 7,   // Double
        9 => 8,   // ComplexHalf
        10 => 9,  // ComplexFloat
        11 => 10, // ComplexDouble
        12 => 11, // Bool
        13 => 15, // BFloat16
        _ => return None,
    })
}

fn c10_layout(serde: i64) -> Option<i64> {
    Some(match serde {
        7 => 0, // Strided
        1 => 1, // Sparse (COO)
        2 => 2, // SparseCsr
        6 => 3, // Mkldnn
        3 => 4, // SparseCsc
        4 => 5, // SparseBsr
        5 => 6, // SparseBsc
        _ => return None,
    })
}

fn c10_memory_format(serde: i64) -> Option<i64> {
    Some(match serde {
        1 => 0, // Contiguous
        4 => 1, // Preserve
        2 => 2, // ChannelsLast
        3 => 3, // ChannelsLast3d
        _ => return None,
    })
}

fn parse_sym_or_int(j: &Json, ids: &mut Ids<'_>) -> GResult<SymOrInt> {
    if let Some(i) = j.get("as_int").and_then(Json::as_i64) {
        Ok(SymOrInt::Int(i))
    } else {
        Ok(SymOrInt::Sym(ids.id(name_of(j)?, false)))
    }
}

/// One `Argument` union value.
fn parse_arg(j: &Json, ids: &mut Ids<'_>, subgraphs: &mut Vec<Graph>) -> GResult<Input> {
    let obj = j
        .as_object()
        .and_then(|o| o.iter().next())
        .ok_or_else(|| format_err(format!("expected an argument, found {j}")))?;
    let (kind, v) = obj;
    let ints = |v: &Json| -> GResult<Vec<i64>> {
        v.as_array()
            .map(|a| a.iter().filter_map(Json::as_i64).collect())
            .ok_or_else(|| format_err(format!("{kind}: expected a list, found {v}")))
    };
    let enum_arg = |map: fn(i64) -> Option<i64>| -> GResult<Input> {
        let raw = v
            .as_i64()
            .ok_or_else(|| format_err(format!("{kind}: expected an int, found {v}")))?;
        map(raw)
            .map(Input::Int)
            .ok_or_else(|| format_err(format!("{kind} {raw} is not one ckptune knows")))
    };
    Ok(match kind.as_str() {
        "as_none" => Input::None,
        "as_tensor" => Input::Tensor(ids.id(name_of(v)?, true)),
        "as_optional_tensor" => match v.get("as_tensor") {
            Some(t) => Input::Tensor(ids.id(name_of(t)?, true)),
            None => Input::None,
        },
        "as_tensors" => Input::Tensors(
            v.as_array()
                .ok_or_else(|| format_err("as_tensors: expected a list"))?
                .iter()
                .map(|t| name_of(t).map(|n| Some(ids.id(n, true))))
                .collect::<GResult<_>>()?,
        ),
        "as_optional_tensors" => Input::Tensors(
            v.as_array()
                .ok_or_else(|| format_err("as_optional_tensors: expected a list"))?
                .iter()
                .map(|t| match t.get("as_tensor") {
                    Some(t) => name_of(t).map(|n| Some(ids.id(n, true))),
                    None => Ok(None),
                })
                .collect::<GResult<_>>()?,
        ),
        "as_int" => Input::Int(v.as_i64().ok_or_else(|| format_err(format!("as_int: {v}")))?),
        "as_ints" => Input::Ints(ints(v)?),
        "as_float" => Input::Float(v.as_f64().ok_or_else(|| format_err(format!("as_float: {v}")))?),
        "as_floats" => Input::Floats(
            v.as_array()
                .map(|a| a.iter().filter_map(Json::as_f64).collect())
                .ok_or_else(|| format_err(format!("as_floats: {v}")))?,
        ),
        "as_bool" => Input::Bool(v.as_bool().ok_or_else(|| format_err(format!("as_bool: {v}")))?),
        "as_bools" => Input::Bools(
            v.as_array()
                .map(|a| a.iter().filter_map(Json::as_bool).collect())
                .ok_or_else(|| format_err(format!("as_bools: {v}")))?,
        ),
        "as_string" => Input::Str(v.as_str().unwrap_or_default().to_owned()),
        "as_device" => {
            // A program exported on the meta device names it where its tensors are made
            // (`arange`, `_assert_tensor_metadata`); ckptune runs such a program in fake mode,
            // whose tensors report the CPU.
            let ty = match v.get("type").and_then(Json::as_str).unwrap_or("cpu") {
                "meta" => "cpu",
                ty => ty,
            };
            match v.get("index").and_then(Json::as_i64) {
                Some(i) => Input::Str(format!("{ty}:{i}")),
                None => Input::Str(ty.to_owned()),
            }
        }
        "as_scalar_type" => enum_arg(c10_scalar_type)?,
        "as_layout" => enum_arg(c10_layout)?,
        "as_memory_format" => enum_arg(c10_memory_format)?,
        "as_sym_int" => match parse_sym_or_int(v, ids)? {
            SymOrInt::Int(i) => Input::Int(i),
            SymOrInt::Sym(s) => Input::Sym(s),
        },
        "as_sym_ints" => Input::SymInts(
            v.as_array()
                .ok_or_else(|| format_err("as_sym_ints: expected a list"))?
                .iter()
                .map(|s| parse_sym_or_int(s, ids))
                .collect::<GResult<_>>()?,
        ),
        "as_graph" => {
            let g = v.get("graph").ok_or_else(|| format_err("as_graph without a graph"))?;
            subgraphs.push(Graph::parse(g)?);
            Input::Graph(subgraphs.len() - 1)
        }
        other => return Err(format_err(format!("argument kind {other} is not supported"))),
    })
}

fn parse_output(j: &Json, ids: &mut Ids<'_>) -> GResult<Output> {
    let (kind, v) = j
        .as_object()
        .and_then(|o| o.iter().next())
        .ok_or_else(|| format_err(format!("expected an output, found {j}")))?;
    Ok(match kind.as_str() {
        "as_tensor" => Output::Tensor(ids.id(name_of(v)?, true)),
        "as_tensors" => Output::Tensors(
            v.as_array()
                .ok_or_else(|| format_err("as_tensors: expected a list"))?
                .iter()
                .map(|t| name_of(t).map(|n| ids.id(n, true)))
                .collect::<GResult<_>>()?,
        ),
        "as_sym_int" => Output::Sym(ids.id(name_of(v)?, false)),
        "as_none" => Output::None,
        other => return Err(format_err(format!("output kind {other} is not supported"))),
    })
}

/// `"L__self__,,reference.ResNet;L__self__layer1,layer1,torch.nn...Sequential"` →
/// `(["L__self__layer1"], ["layer1"])`: each entry's key (which call) and module path, the root
/// (empty path) left out.
fn parse_module_stack(s: &str) -> (Vec<String>, Vec<String>) {
    s.split(';')
        .filter_map(|entry| {
            let mut fields = entry.split(',');
            Some((fields.next()?, fields.next()?))
        })
        // torch.export marks nodes it made without a module (`sym_size` of an input) with a
        // placeholder entry that is no module.
        .filter(|(_, path)| !path.is_empty() && !path.starts_with("_empty_nn_module_stack"))
        .map(|(key, path)| (key.to_owned(), path.to_owned()))
        .unzip()
}

fn parse_target(node: &str, t: &str) -> GResult<Target> {
    let unsupported = |why: &str| GraphError::Unsupported {
        node: node.to_owned(),
        target: t.to_owned(),
        why: why.to_owned(),
    };
    if let Some(rest) = t.strip_prefix("torch.ops.higher_order.") {
        return match rest {
            "wrap_with_set_grad_enabled" => Ok(Target::SetGrad),
            "wrap_with_autocast" => Ok(Target::Autocast),
            _ => Err(unsupported(
                "higher-order ops other than wrap_with_set_grad_enabled and wrap_with_autocast (cond, \
                 while_loop, map, …) are not supported; export a model without data-dependent control flow",
            )),
        };
    }
    if let Some(rest) = t.strip_prefix("torch.ops.") {
        let parts: Vec<&str> = rest.split('.').collect();
        if parts.len() != 3 {
            return Err(unsupported("expected torch.ops.<namespace>.<op>.<overload>"));
        }
        let overload = if parts[2] == "default" { "" } else { parts[2] };
        return Ok(Target::Op {
            name: format!("{}::{}", parts[0], parts[1]),
            overload: overload.to_owned(),
        });
    }
    let py = match t {
        "_operator.getitem" => return Ok(Target::GetItem),
        "_operator.add" => PyOp::Add,
        "_operator.sub" => PyOp::Sub,
        "_operator.mul" => PyOp::Mul,
        "_operator.floordiv" => PyOp::FloorDiv,
        "_operator.truediv" => PyOp::TrueDiv,
        "_operator.mod" => PyOp::Mod,
        "_operator.neg" => PyOp::Neg,
        "_operator.eq" => PyOp::Eq,
        "_operator.ne" => PyOp::Ne,
        "_operator.lt" => PyOp::Lt,
        "_operator.le" => PyOp::Le,
        "_operator.gt" => PyOp::Gt,
        "_operator.ge" => PyOp::Ge,
        _ => {
            return Err(unsupported(
                "only torch.ops operators, Python's scalar operators and getitem are supported",
            ))
        }
    };
    Ok(Target::Python(py))
}

impl Graph {
    /// Parses a serialized `Graph`.
    pub fn parse(j: &Json) -> GResult<Graph> {
        let mut g = Graph {
            names: Vec::new(),
            is_tensor: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            nodes: Vec::new(),
            subgraphs: Vec::new(),
            last_use: Vec::new(),
        };
        let mut subgraphs = Vec::new();
        let mut nodes = Vec::new();
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        {
            let mut ids = Ids {
                map: HashMap::new(),
                graph: &mut g,
            };
            for (k, i) in j
                .get("inputs")
                .and_then(Json::as_array)
                .into_iter()
                .flatten()
                .enumerate()
            {
                match parse_arg(i, &mut ids, &mut subgraphs)? {
                    Input::Tensor(v) | Input::Sym(v) => inputs.push(v),
                    // A constant user input (`use_cache=False` passed as a keyword when exporting):
                    // torch.export specialized the graph on its value, so no node reads it. It
                    // keeps its place, which the signature's input specs are matched by.
                    Input::None | Input::Int(_) | Input::Float(_) | Input::Bool(_) | Input::Str(_) => {
                        inputs.push(ids.id(&format!("<constant input {k}>"), false))
                    }
                    other => return Err(format_err(format!("graph input {other:?} is not a tensor or a size"))),
                }
            }
            for n in j
                .get("nodes")
                .and_then(Json::as_array)
                .ok_or_else(|| format_err("graph without nodes"))?
            {
                let name = n.get("name").and_then(Json::as_str).unwrap_or("?").to_owned();
                let target_text = n.get("target").and_then(Json::as_str).unwrap_or("?").to_owned();
                let target = parse_target(&name, &target_text)?;
                let mut args = Vec::new();
                for (k, a) in n
                    .get("inputs")
                    .and_then(Json::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    let an = a
                        .get("name")
                        .and_then(Json::as_str)
                        .map_or_else(|| format!("#{k}"), str::to_owned);
                    let arg = a
                        .get("arg")
                        .ok_or_else(|| format_err(format!("node {name}: input without arg")))?;
                    args.push((an, parse_arg(arg, &mut ids, &mut subgraphs)?));
                }
                let outs = n
                    .get("outputs")
                    .and_then(Json::as_array)
                    .into_iter()
                    .flatten()
                    .map(|o| parse_output(o, &mut ids))
                    .collect::<GResult<Vec<_>>>()?;
                let (calls, modules) = n
                    .get("metadata")
                    .and_then(|m| m.get("nn_module_stack"))
                    .and_then(Json::as_str)
                    .map(parse_module_stack)
                    .unwrap_or_default();
                nodes.push(Node {
                    name,
                    target_text,
                    target,
                    args,
                    outputs: outs,
                    modules,
                    calls,
                });
            }
            for o in j.get("outputs").and_then(Json::as_array).into_iter().flatten() {
                outputs.push(parse_arg(o, &mut ids, &mut subgraphs)?);
            }
        }
        g.inputs = inputs;
        g.nodes = nodes;
        g.outputs = outputs;
        g.subgraphs = subgraphs;
        g.last_use = vec![None; g.names.len()];
        for (k, n) in g.nodes.iter().enumerate() {
            for v in n.reads() {
                g.last_use[v] = Some(k);
            }
        }
        for o in &g.outputs {
            for v in o.reads() {
                g.last_use[v] = Some(g.nodes.len());
            }
        }
        Ok(g)
    }

    /// Node index that defines each value (`None` for graph inputs).
    pub fn definitions(&self) -> Vec<Option<usize>> {
        let mut def = vec![None; self.names.len()];
        for (k, n) in self.nodes.iter().enumerate() {
            for v in n.defines() {
                def[v] = Some(k);
            }
        }
        def
    }

    /// Checks that the dispatcher has every operator, and the subgraphs' too.
    pub fn check_ops(&self) -> GResult<()> {
        for n in &self.nodes {
            if let Target::Op { name, overload } = &n.target {
                ops::schema(name, overload).map_err(|e| GraphError::Unsupported {
                    node: n.name.clone(),
                    target: n.target_text.clone(),
                    why: format!(
                        "libtorch's dispatcher has no such operator ({e}); a custom operator must be \
                         registered in libtorch (TORCH_LIBRARY) to run outside Python"
                    ),
                })?;
            }
        }
        self.subgraphs.iter().try_for_each(Graph::check_ops)
    }
}
