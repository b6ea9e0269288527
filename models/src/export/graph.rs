//! The graph of a `torch.export` program as `models/model.json` writes it (schema of
//! `torch/_export/serde/schema.py`, major version 8), parsed into nodes that reference values by
//! index, and the interpreter that runs a range of nodes: every ATen node is one generic boxed
//! call through libtorch's dispatcher ([`ckptune_kernels::ops::call`]); only Python's scalar
//! operators (`operator.mul` on symbolic sizes), `getitem` and the higher-order op
//! `wrap_with_set_grad_enabled` are evaluated here.

use std::collections::HashMap;
use std::sync::Mutex;

use ckptune_kernels::ops::{self, Arg, Value};
use serde_json::Value as Json;
use tch::Tensor;

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
    fn reads(&self) -> Vec<usize> {
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
            let ty = v.get("type").and_then(Json::as_str).unwrap_or("cpu");
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
/// `["layer1"]`: the second field of each entry, the root (empty) left out.
fn parse_module_stack(s: &str) -> Vec<String> {
    s.split(';')
        .filter_map(|entry| entry.split(',').nth(1))
        // torch.export marks nodes it made without a module (`sym_size` of an input) with a
        // placeholder entry that is no module.
        .filter(|path| !path.is_empty() && !path.starts_with("_empty_nn_module_stack"))
        .map(str::to_owned)
        .collect()
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
                let modules = n
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

fn share(v: &Value) -> Value {
    match v {
        Value::None => Value::None,
        Value::Tensor(t) => Value::Tensor(t.shallow_clone()),
        Value::Int(i) => Value::Int(*i),
        Value::Float(f) => Value::Float(*f),
        Value::Bool(b) => Value::Bool(*b),
        Value::List(l) => Value::List(l.iter().map(share).collect()),
    }
}

/// Where the values a run reads live: `local` (defined or passed in for this run), then the
/// program's parameters, buffers and constants (`statics`). Symbolic ints are written to and
/// read from `syms`, shared by every block: they depend only on the input's shape.
pub(crate) struct Env<'a> {
    pub local: Vec<Option<Value>>,
    pub statics: &'a [Option<Tensor>],
    pub syms: &'a Mutex<Vec<Option<i64>>>,
}

impl Env<'_> {
    fn tensor(&self, v: usize, g: &Graph, node: &Node) -> GResult<&Tensor> {
        match self.local[v].as_ref() {
            Some(Value::Tensor(t)) => Ok(t),
            Some(other) => Err(run_err(
                node,
                format!("value {} is {}, not a tensor", g.names[v], other.describe()),
            )),
            None => self.statics.get(v).and_then(Option::as_ref).ok_or_else(|| {
                run_err(
                    node,
                    format!("value {} is not available (freed or never computed)", g.names[v]),
                )
            }),
        }
    }

    fn sym(&self, v: usize, g: &Graph, node: &Node) -> GResult<i64> {
        if let Some(Value::Int(i)) = self.local[v].as_ref() {
            return Ok(*i);
        }
        self.syms
            .lock()
            .ok()
            .and_then(|s| s.get(v).copied().flatten())
            .ok_or_else(|| run_err(node, format!("symbolic size {} is not known yet", g.names[v])))
    }
}

fn run_err(node: &Node, why: String) -> GraphError {
    GraphError::Unsupported {
        node: node.name.clone(),
        target: node.target_text.clone(),
        why,
    }
}

fn py_scalar(v: &Value) -> Option<f64> {
    match v {
        Value::Int(i) => Some(*i as f64),
        Value::Float(f) => Some(*f),
        Value::Bool(b) => Some(*b as i64 as f64),
        _ => None,
    }
}

fn py_op(op: PyOp, a: &Value, b: Option<&Value>) -> Option<Value> {
    use PyOp::*;
    if let (Value::Int(x), Some(Value::Int(y))) = (a, b) {
        let (x, y) = (*x, *y);
        return Some(match op {
            Add => Value::Int(x + y),
            Sub => Value::Int(x - y),
            Mul => Value::Int(x * y),
            FloorDiv if y != 0 => Value::Int(x.div_euclid(y) - if y < 0 && x.rem_euclid(y) != 0 { 1 } else { 0 }),
            TrueDiv if y != 0 => Value::Float(x as f64 / y as f64),
            Mod if y != 0 => Value::Int(((x % y) + y) % y),
            Eq => Value::Bool(x == y),
            Ne => Value::Bool(x != y),
            Lt => Value::Bool(x < y),
            Le => Value::Bool(x <= y),
            Gt => Value::Bool(x > y),
            Ge => Value::Bool(x >= y),
            _ => return None,
        });
    }
    if let (Neg, Value::Int(x)) = (op, a) {
        return Some(Value::Int(-x));
    }
    let x = py_scalar(a)?;
    if let Neg = op {
        return Some(Value::Float(-x));
    }
    let y = py_scalar(b?)?;
    Some(match op {
        Add => Value::Float(x + y),
        Sub => Value::Float(x - y),
        Mul => Value::Float(x * y),
        TrueDiv => Value::Float(x / y),
        FloorDiv => Value::Float((x / y).floor()),
        Mod => Value::Float(x - y * (x / y).floor()),
        Eq => Value::Bool(x == y),
        Ne => Value::Bool(x != y),
        Lt => Value::Bool(x < y),
        Le => Value::Bool(x <= y),
        Gt => Value::Bool(x > y),
        Ge => Value::Bool(x >= y),
        Neg => unreachable!("handled above"),
    })
}

impl Graph {
    /// Runs nodes `range` in `env`. A value is dropped right after the node that reads it last
    /// (or, if nothing reads it, right after the node that made it) unless `keep` says it is
    /// the run's output: eager PyTorch frees a temporary when its last Python reference dies,
    /// and the meter must see the same.
    pub fn run(&self, range: std::ops::Range<usize>, env: &mut Env<'_>, keep: &dyn Fn(usize) -> bool) -> GResult<()> {
        for k in range {
            let node = &self.nodes[k];
            let results = self.run_node(node, env)?;
            for (out, val) in node.outputs.iter().zip(results) {
                match (out, val) {
                    (Output::None, _) => {}
                    (Output::Tensor(v), val @ Value::Tensor(_)) => env.local[*v] = Some(val),
                    (Output::Sym(v), val) => {
                        let i = match val {
                            Value::Int(i) => i,
                            other => {
                                return Err(run_err(
                                    node,
                                    format!("returned {} for a symbolic int", other.describe()),
                                ))
                            }
                        };
                        if let Ok(mut s) = env.syms.lock() {
                            s[*v] = Some(i);
                        }
                        env.local[*v] = Some(Value::Int(i));
                    }
                    (Output::Tensors(vs), Value::List(items)) => {
                        for (v, item) in vs.iter().zip(items) {
                            env.local[*v] = Some(item);
                        }
                    }
                    (o, val) => return Err(run_err(node, format!("returned {} for output {o:?}", val.describe()))),
                }
            }
            // Free what is dead after this node: its inputs read for the last time, and its
            // outputs nothing reads.
            for v in node.reads().into_iter().chain(node.defines()) {
                if !keep(v) && self.last_use[v].is_none_or(|last| last <= k) {
                    env.local[v] = None;
                }
            }
        }
        Ok(())
    }

    fn arg<'e>(&self, input: &Input, env: &'e Env<'_>, node: &Node) -> GResult<Arg<'e>> {
        Ok(match input {
            Input::None => Arg::None,
            Input::Tensor(v) => Arg::Tensor(env.tensor(*v, self, node)?),
            Input::Tensors(vs) => Arg::Tensors(
                vs.iter()
                    .map(|v| v.map(|v| env.tensor(v, self, node)).transpose())
                    .collect::<GResult<_>>()?,
            ),
            Input::Int(i) => Arg::Int(*i),
            Input::Float(f) => Arg::Float(*f),
            Input::Bool(b) => Arg::Bool(*b),
            Input::Ints(v) => Arg::Ints(v.clone()),
            Input::Floats(v) => Arg::Floats(v.clone()),
            Input::Bools(v) => Arg::Bools(v.clone()),
            Input::Str(s) => Arg::Str(s.clone()),
            Input::Sym(v) => Arg::Int(env.sym(*v, self, node)?),
            Input::SymInts(vs) => Arg::Ints(
                vs.iter()
                    .map(|s| match s {
                        SymOrInt::Int(i) => Ok(*i),
                        SymOrInt::Sym(v) => env.sym(*v, self, node),
                    })
                    .collect::<GResult<_>>()?,
            ),
            Input::Graph(_) => return Err(run_err(node, "a subgraph is not an operator argument".into())),
        })
    }

    fn value_of(&self, input: &Input, env: &Env<'_>, node: &Node) -> GResult<Value> {
        Ok(match self.arg(input, env, node)? {
            Arg::Tensor(t) => Value::Tensor(t.shallow_clone()),
            Arg::Int(i) => Value::Int(i),
            Arg::Float(f) => Value::Float(f),
            Arg::Bool(b) => Value::Bool(b),
            Arg::None => Value::None,
            Arg::Tensors(ts) => Value::List(
                ts.into_iter()
                    .map(|t| t.map_or(Value::None, |t| Value::Tensor(t.shallow_clone())))
                    .collect(),
            ),
            Arg::Ints(v) => Value::List(v.into_iter().map(Value::Int).collect()),
            other => return Err(run_err(node, format!("{other:?} is not a Python operand"))),
        })
    }

    fn run_node(&self, node: &Node, env: &mut Env<'_>) -> GResult<Vec<Value>> {
        match &node.target {
            Target::Op { name, overload } => {
                let args: Vec<(&str, Arg<'_>)> = node
                    .args
                    .iter()
                    .map(|(n, a)| self.arg(a, env, node).map(|a| (n.as_str(), a)))
                    .collect::<GResult<_>>()?;
                ops::call(name, overload, &args).map_err(|e| run_err(node, e.to_string()))
            }
            Target::Python(op) => {
                let a = node
                    .args
                    .first()
                    .map(|(_, a)| self.value_of(a, env, node))
                    .transpose()?;
                let b = node.args.get(1).map(|(_, a)| self.value_of(a, env, node)).transpose()?;
                let a = a.ok_or_else(|| run_err(node, "no operand".into()))?;
                py_op(*op, &a, b.as_ref())
                    .map(|v| vec![v])
                    .ok_or_else(|| run_err(node, format!("cannot apply {op:?} to {} and {:?}", a.describe(), b)))
            }
            Target::GetItem => {
                let list = node
                    .args
                    .first()
                    .map(|(_, a)| self.value_of(a, env, node))
                    .transpose()?;
                let idx = match node.args.get(1).map(|(_, a)| a) {
                    Some(Input::Int(i)) => *i,
                    other => return Err(run_err(node, format!("getitem index {other:?} is not an int"))),
                };
                match list {
                    Some(Value::List(items)) => {
                        let n = items.len() as i64;
                        let i = if idx < 0 { idx + n } else { idx };
                        items
                            .get(i as usize)
                            .map(|v| vec![share(v)])
                            .ok_or_else(|| run_err(node, format!("index {idx} out of a list of {n}")))
                    }
                    other => Err(run_err(node, format!("getitem on {other:?}"))),
                }
            }
            Target::SetGrad => {
                let enabled = match node.args.first().map(|(_, a)| a) {
                    Some(Input::Bool(b)) => *b,
                    other => return Err(run_err(node, format!("expected the grad mode, found {other:?}"))),
                };
                if enabled {
                    tch::with_grad(|| self.run_subgraph(node, 1, env))
                } else {
                    tch::no_grad(|| self.run_subgraph(node, 1, env))
                }
            }
            Target::Autocast => {
                let arg = |k: usize| node.args.get(k).map(|(_, a)| a);
                let device = match arg(0) {
                    Some(Input::Str(d)) if d == "cpu" => tch::Device::Cpu,
                    Some(Input::Str(d)) if d.starts_with("cuda") => tch::Device::Cuda(0),
                    other => return Err(run_err(node, format!("expected the device type, found {other:?}"))),
                };
                let enabled = match arg(2) {
                    Some(Input::Bool(b)) => *b,
                    other => return Err(run_err(node, format!("expected `enabled`, found {other:?}"))),
                };
                // torch.autocast's dtype defaults to the device's current autocast dtype.
                let dtype = match arg(1) {
                    Some(Input::Int(15)) => tch::Kind::BFloat16,
                    Some(Input::Int(5)) => tch::Kind::Half,
                    Some(Input::Int(6)) => tch::Kind::Float,
                    Some(Input::None) | None => ckptune_kernels::autocast::dtype(device).unwrap_or(tch::Kind::BFloat16),
                    other => {
                        return Err(run_err(
                            node,
                            format!("autocast dtype {other:?} is not bf16, f16 or f32"),
                        ))
                    }
                };
                let _guard = ckptune_kernels::autocast::AutocastGuard::new(device, dtype, enabled)
                    .map_err(|e| run_err(node, e.to_string()))?;
                self.run_subgraph(node, 4, env)
            }
        }
    }

    /// Runs the subgraph that argument `at` of a higher-order node holds on the operands after
    /// it, in whatever grad or autocast mode the caller set.
    fn run_subgraph(&self, node: &Node, at: usize, env: &mut Env<'_>) -> GResult<Vec<Value>> {
        let sub = match node.args.get(at).map(|(_, a)| a) {
            Some(Input::Graph(i)) => &self.subgraphs[*i],
            other => return Err(run_err(node, format!("expected a subgraph, found {other:?}"))),
        };
        let operands: Vec<Value> = node.args[at + 1..]
            .iter()
            .map(|(_, a)| self.value_of(a, env, node))
            .collect::<GResult<_>>()?;
        if operands.len() != sub.inputs.len() {
            return Err(run_err(
                node,
                format!(
                    "{} operands for a subgraph of {} inputs",
                    operands.len(),
                    sub.inputs.len()
                ),
            ));
        }
        let syms = Mutex::new(vec![None; sub.names.len()]);
        let mut inner = Env {
            local: (0..sub.names.len()).map(|_| None).collect(),
            statics: &[],
            syms: &syms,
        };
        for (&v, val) in sub.inputs.iter().zip(operands) {
            if let Value::Int(i) = val {
                if let Ok(mut s) = syms.lock() {
                    s[v] = Some(i);
                }
            }
            inner.local[v] = Some(val);
        }
        let outs: Vec<usize> = sub.outputs.iter().flat_map(Input::reads).collect();
        let keep = |v: usize| outs.contains(&v);
        sub.run(0..sub.nodes.len(), &mut inner, &keep)?;
        sub.outputs
            .iter()
            .map(|o| sub.value_of(o, &inner, node))
            .collect::<GResult<Vec<_>>>()
    }
}
