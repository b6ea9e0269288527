//! The operators a thread runs (`csrc/optrace.cpp`): name, nesting depth, input and output
//! shapes, the meter's levels around each and its peak inside, and its wall time, with the
//! user scopes ([`Scope`]) that say what each operator was part of. Lined up between a real and
//! a fake run of the same step it shows where their bytes differ; its shapes give each
//! operator's work for the cost model.

use std::ffi::{c_char, c_void, CStr, CString};
use std::marker::PhantomData;

use tch::Kind;

use crate::{ffi, KernelError};

/// One operator call, or one user scope.
#[derive(Debug, Clone, PartialEq)]
pub struct OpEvent {
    /// The operator with its overload (`aten::addmm`, `aten::add.Tensor`), an autograd
    /// node's evaluation (`autograd::engine::evaluate_function: MmBackward0`), or a scope's name.
    pub name: String,
    /// A user scope ([`Scope`]), not an operator.
    pub scope: bool,
    /// Operators it runs inside (0: called by the step itself); scopes add none.
    pub depth: u32,
    /// One past the last event that started before it ended: the events after it up to `end`
    /// ran inside it.
    pub end: usize,
    /// Meter levels when it started and ended, and the highest while it ran.
    pub enter: i64,
    pub exit: i64,
    pub peak: i64,
    pub seconds: f64,
    /// Per input: a tensor's dtype and sizes, or `None` for anything but a tensor.
    pub inputs: Vec<Option<(Kind, Vec<i64>)>>,
    /// Per input: the value of a number (an integer, a bool as 0 or 1, a double), else `None`.
    pub numbers: Vec<Option<f64>>,
    /// Per output, as `inputs` (empty for a scope).
    pub outputs: Vec<Option<(Kind, Vec<i64>)>>,
    /// The inputs as the shim writes them (`csrc/shape_code.h`): with the name, [`op_key`].
    pub codes: Vec<i64>,
}

impl OpEvent {
    /// Bytes of its tensor inputs, as dense tensors of their sizes.
    pub fn input_bytes(&self) -> i64 {
        self.inputs
            .iter()
            .flatten()
            .map(|(kind, sizes)| sizes.iter().product::<i64>() * kind.elt_size_in_bytes() as i64)
            .sum()
    }

    /// Whether input `i` is a matrix (or a batch of them) stored transposed: column-major in
    /// its last two dimensions (`x.t()`), which a product's kernel may reorder first.
    pub fn column_major(&self, i: usize) -> bool {
        let Some((_, sizes, strides)) = tensor_codes(&self.codes).nth(i).flatten() else {
            return false;
        };
        let n = sizes.len();
        n >= 2 && sizes[n - 1] > 1 && sizes[n - 2] > 1 && strides[n - 2] == 1 && strides[n - 1] != 1
    }
}

/// Per value of `flat`, shapes as the shim writes them (`[dtype, ndim, sizes..., strides...]`
/// per tensor, `[-1]` per anything else): a tensor's `c10::ScalarType`, sizes and strides, or
/// `None`.
fn tensor_codes(mut flat: &[i64]) -> impl Iterator<Item = Option<(i64, &[i64], &[i64])>> {
    std::iter::from_fn(move || {
        let (&dtype, rest) = flat.split_first()?;
        if dtype < 0 {
            flat = rest;
            return Some(None);
        }
        let ndim = rest.first().copied().unwrap_or(0).max(0) as usize;
        let sizes = rest.get(1..1 + ndim).unwrap_or_default();
        let strides = rest.get(1 + ndim..1 + 2 * ndim).unwrap_or_default();
        flat = rest.get(1 + 2 * ndim..).unwrap_or_default();
        Some(Some((dtype, sizes, strides)))
    })
}

/// Whether operator `name` (`aten::add.Tensor`, as [`OpEvent::name`] has it) has a kernel for
/// the meta device, so that a fake step can run it; `None` for an operator libtorch lacks.
pub fn has_meta_kernel(name: &str) -> Option<bool> {
    let c = std::ffi::CString::new(name).ok()?;
    match unsafe { ffi::ckpt_op_has_meta_kernel(c.as_ptr()) } {
        -1 => None,
        v => Some(v == 1),
    }
}

/// What the cost model needs to know of an operator, from libtorch's dispatcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpTraits {
    /// Only a `CompositeImplicitAutograd` kernel: the operators it calls do its work.
    pub decomposition: bool,
    /// Returns a view of an input (no data moves).
    pub view: bool,
    /// Writes into an input (in place, or `out=`).
    pub writes_input: bool,
}

/// [`OpTraits`] of operator `name` (`aten::addmm`, `aten::add.Tensor`, as [`OpEvent::name`]
/// has it); `None` for anything that is not an operator (an autograd node, a scope).
pub fn op_traits(name: &str) -> Option<OpTraits> {
    let c = CString::new(name).ok()?;
    let bits = unsafe { ffi::ckpt_op_traits(c.as_ptr()) };
    (bits & 1 == 1).then_some(OpTraits {
        decomposition: bits & 2 != 0,
        view: bits & 4 != 0,
        writes_input: bits & 8 != 0,
    })
}

/// A user scope named `name` around what this thread runs until it is dropped
/// (`at::RecordFunction` with `USER_SCOPE`, what `torch.profiler.record_function` opens): the
/// trace records it, and so would the PyTorch profiler. Scopes nest; each must be dropped on
/// the thread that opened it, after any scope opened inside it.
#[derive(Debug)]
pub struct Scope {
    // Scopes live on one thread's stack in the shim.
    _not_send: PhantomData<*const ()>,
}

impl Scope {
    pub fn enter(name: &str) -> Result<Scope, KernelError> {
        let c = CString::new(name).map_err(|_| KernelError::Invalid {
            op: "opening a trace scope",
            message: format!("the name {name:?} holds a NUL byte"),
        })?;
        ffi::check("opening a trace scope", |e| unsafe {
            ffi::ckpt_scope_enter(c.as_ptr(), e)
        })?;
        Ok(Scope { _not_send: PhantomData })
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        unsafe { ffi::ckpt_scope_exit() }
    }
}

/// Traces this thread's operators until [`stop`]; starting again drops what was traced.
pub fn start() -> Result<(), KernelError> {
    ffi::check("starting the operator trace", |e| unsafe { ffi::ckpt_optrace_start(e) })
}

/// Stops tracing and returns the operators in the order they started.
pub fn stop() -> Result<Vec<OpEvent>, KernelError> {
    let mut out: Vec<OpEvent> = Vec::new();
    ffi::check("reading the operator trace", |e| unsafe {
        ffi::ckpt_optrace_stop(&mut out as *mut Vec<OpEvent> as *mut c_void, push_event, e)
    })?;
    Ok(out)
}

#[allow(clippy::too_many_arguments)] // the C callback's signature
extern "C" fn push_event(
    ctx: *mut c_void,
    name: *const c_char,
    scope: i32,
    depth: i32,
    end: i64,
    enter: i64,
    exit: i64,
    peak: i64,
    nanos: i64,
    inputs: *const i64,
    ninputs: i64,
    outputs: *const i64,
    noutputs: i64,
    numbers: *const i64,
    nnumbers: i64,
) {
    // SAFETY: ctx is the Vec `stop` passes; name is NUL-terminated, inputs, outputs and numbers
    // hold ninputs, noutputs and nnumbers values, all alive for the call.
    let out = unsafe { &mut *(ctx as *mut Vec<OpEvent>) };
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    let slice = |p: *const i64, n: i64| {
        if n <= 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(p, n as usize) }
        }
    };
    let codes = slice(inputs, ninputs);
    out.push(OpEvent {
        name,
        scope: scope != 0,
        depth: depth.max(0) as u32,
        end: end.max(0) as usize,
        enter,
        exit,
        peak,
        seconds: nanos as f64 * 1e-9,
        inputs: decode_shapes(codes),
        numbers: decode_numbers(slice(numbers, nnumbers)),
        outputs: decode_shapes(slice(outputs, noutputs)),
        codes: codes.to_vec(),
    });
}

/// `[1, value]` per integer or bool, `[2, bits]` per double, `[0, 0]` per anything else.
fn decode_numbers(flat: &[i64]) -> Vec<Option<f64>> {
    flat.chunks(2)
        .map(|p| match p {
            [1, v] => Some(*v as f64),
            [2, bits] => Some(f64::from_bits(*bits as u64)),
            _ => None,
        })
        .collect()
}

/// Each value's dtype and sizes where it is a tensor ([`tensor_codes`]).
fn decode_shapes(flat: &[i64]) -> Vec<Option<(Kind, Vec<i64>)>> {
    tensor_codes(flat)
        .map(|t| t.and_then(|(dtype, sizes, _)| kind_of(dtype).map(|k| (k, sizes.to_vec()))))
        .collect()
}

/// A `c10::ScalarType` as tch's kind (the types a training step uses).
fn kind_of(scalar_type: i64) -> Option<Kind> {
    Some(match scalar_type {
        0 => Kind::Uint8,
        1 => Kind::Int8,
        2 => Kind::Int16,
        3 => Kind::Int,
        4 => Kind::Int64,
        5 => Kind::Half,
        6 => Kind::Float,
        7 => Kind::Double,
        11 => Kind::Bool,
        15 => Kind::BFloat16,
        _ => return None,
    })
}

/// Where a fake step's bytes differ from the real step's: one operator called by the step.
#[derive(Debug, Clone, PartialEq)]
pub struct PeakDifference {
    /// Its position among the step's own calls, and its name.
    pub index: usize,
    pub name: String,
    /// The innermost real operator that reached the real peak (`aten::mm` in oneDNN's scratch).
    pub culprit: String,
    /// Bytes the real operator held at its peak beyond the fake one's.
    pub bytes: i64,
    /// Bytes of the culprit's tensor inputs, to bound the difference by.
    pub operands: i64,
}

/// Lines up a real and a fake trace of the same step by the operators the step itself calls
/// (what runs inside them may differ: a meta kernel is not the CPU kernel), less the real
/// step's reads of values and the scopes. Each call must
/// leave the same bytes behind; where their peaks differ, the difference is returned. `Err`
/// names the first call that is not the same in both.
pub fn line_up(real: &[OpEvent], fake: &[OpEvent]) -> Result<Vec<PeakDifference>, String> {
    // A real step reads values (the loss) that a fake one has not: those reads allocate nothing.
    let read = |e: &OpEvent| e.name == "aten::item" || e.name == "aten::_local_scalar_dense";
    let top = |t: &[OpEvent]| -> Vec<usize> {
        (0..t.len())
            .filter(|&i| t[i].depth == 0 && !t[i].scope && !read(&t[i]))
            .collect()
    };
    let (r, f) = (top(real), top(fake));
    let mut out = Vec::new();
    for (index, (&i, &j)) in r.iter().zip(&f).enumerate() {
        let (a, b) = (&real[i], &fake[j]);
        let kept = (a.exit - a.enter, b.exit - b.enter);
        if a.name != b.name || kept.0 != kept.1 {
            return Err(format!(
                "call {index}: real {} keeps {} B, fake {} keeps {} B",
                a.name, kept.0, b.name, kept.1
            ));
        }
        let bytes = (a.peak - a.enter) - (b.peak - b.enter);
        if bytes != 0 {
            let end = real[i + 1..]
                .iter()
                .position(|e| e.depth == 0)
                .map_or(real.len(), |k| i + 1 + k);
            let culprit = real[i..end]
                .iter()
                .filter(|e| e.peak == a.peak)
                .max_by_key(|e| e.depth)
                .unwrap_or(a);
            out.push(PeakDifference {
                index,
                name: a.name.clone(),
                culprit: culprit.name.clone(),
                bytes,
                operands: culprit.input_bytes(),
            });
        }
    }
    if r.len() != f.len() {
        return Err(format!(
            "the real step makes {} calls, the fake one {}",
            r.len(),
            f.len()
        ));
    }
    Ok(out)
}

/// An operator call's key for fake mode's learned scratch: its name and its inputs' codes, as
/// `csrc/shape_code.h` writes them.
pub fn op_key(e: &OpEvent) -> String {
    let codes: Vec<String> = e.codes.iter().map(i64::to_string).collect();
    format!("{}|{}", e.name, codes.join(","))
}

/// Whether an event is a dispatcher operator: not a scope, not an autograd node's evaluation
/// (`autograd::engine::evaluate_function: …`), not autograd's own `detach`.
pub fn is_operator(e: &OpEvent) -> bool {
    !e.scope && e.name.contains("::") && !e.name.starts_with("autograd::") && !e.name.starts_with("ckptune::")
}

/// The operator calls the step itself makes (those inside no other operator: autograd's
/// evaluations and scopes are not operators), in order.
pub fn outermost_ops(events: &[OpEvent]) -> Vec<&OpEvent> {
    // Per open depth, whether an operator is open at or above it.
    let mut inside: Vec<bool> = Vec::new();
    let mut out = Vec::new();
    for e in events {
        let d = e.depth as usize;
        inside.truncate(d);
        let under_operator = inside.last().copied().unwrap_or(false);
        if is_operator(e) && !under_operator {
            out.push(e);
        }
        while inside.len() < d {
            inside.push(under_operator);
        }
        inside.push(under_operator || is_operator(e));
    }
    out
}

/// What a real step's kernels allocate beyond a fake run of the same step: per operator and
/// inputs (the step's own calls, [`outermost_ops`]), the bytes by which the real call's peak
/// exceeds the fake call's; the largest such excess where one operator and inputs recur
/// (`csrc/learned_scratch.cpp` lifts a fake call's peak by it). `Err` names the first call that keeps other
/// bytes or allocates more when fake: no table makes those steps equal.
pub fn learned_scratch(real: &[OpEvent], fake: &[OpEvent]) -> Result<Vec<(String, i64)>, String> {
    let read = |e: &&OpEvent| e.name != "aten::item" && e.name != "aten::_local_scalar_dense";
    let r: Vec<&OpEvent> = outermost_ops(real).into_iter().filter(read).collect();
    let f: Vec<&OpEvent> = outermost_ops(fake).into_iter().filter(read).collect();
    if r.len() != f.len() {
        return Err(format!(
            "the real step makes {} operator calls, the fake one {}",
            r.len(),
            f.len()
        ));
    }
    let mut table: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    for (i, (a, b)) in r.iter().zip(&f).enumerate() {
        let (kept_real, kept_fake) = (a.exit - a.enter, b.exit - b.enter);
        let (peak_real, peak_fake) = (a.peak - a.enter, b.peak - b.enter);
        if a.name != b.name || kept_real != kept_fake || peak_fake > peak_real {
            return Err(format!(
                "call {i}: real {} keeps {kept_real} B and peaks {peak_real} B above its start, \
                 fake {} keeps {kept_fake} B and peaks {peak_fake} B",
                a.name, b.name
            ));
        }
        if peak_real > peak_fake {
            let excess = peak_real - peak_fake;
            let entry = table.entry(op_key(a)).or_insert(0);
            *entry = (*entry).max(excess);
        }
    }
    Ok(table.into_iter().collect())
}
