//! Running a range of a program's nodes: every ATen node is one generic boxed call through
//! libtorch's dispatcher ([`ckptune_kernels::ops::call`]); only Python's scalar operators
//! (`operator.mul` on symbolic sizes), `getitem` and the higher-order ops
//! `wrap_with_set_grad_enabled` and `wrap_with_autocast` are evaluated here. Every value is
//! dropped after its last reader, as PyTorch's graph interpreter frees it.

use std::sync::Mutex;

use ckptune_kernels::ops::{self, Arg, Value};
use tch::Tensor;

use super::autocast;
use super::graph::{GResult, Graph, GraphError, Input, Node, Output, PyOp, SymOrInt, Target};

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
            Target::Op { name, .. } if autocast::skipped(name) => Ok(Vec::new()),
            Target::Op { name, overload } => {
                let mut args: Vec<(&str, Arg<'_>)> = node
                    .args
                    .iter()
                    .map(|(n, a)| self.arg(a, env, node).map(|a| (n.as_str(), a)))
                    .collect::<GResult<_>>()?;
                autocast::fit_extremes(&mut args);
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
