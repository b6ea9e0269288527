//! The operators a thread runs (`csrc/optrace.cpp`): name, nesting depth, input shapes, the
//! meter's levels around each and its peak inside, and its wall time. Lined up between a real
//! and a fake run of the same step it shows where their bytes differ; its shapes give each
//! operator's work for the cost model.

use std::ffi::{c_char, c_void, CStr};

use tch::Kind;

use crate::{ffi, KernelError};

/// One operator call.
#[derive(Debug, Clone, PartialEq)]
pub struct OpEvent {
    /// The operator with its overload (`aten::addmm`, `aten::add.Tensor`), or an autograd
    /// node's evaluation (`autograd::engine::evaluate_function: MmBackward0`).
    pub name: String,
    /// Operators it runs inside (0: called by the step itself).
    pub depth: u32,
    /// Meter levels when it started and ended, and the highest while it ran.
    pub enter: i64,
    pub exit: i64,
    pub peak: i64,
    pub seconds: f64,
    /// Per input: a tensor's dtype and sizes, or `None` for anything but a tensor.
    pub inputs: Vec<Option<(Kind, Vec<i64>)>>,
    /// The same as the shim writes it (`csrc/shape_code.h`): with the name, [`op_key`].
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

extern "C" fn push_event(
    ctx: *mut c_void,
    name: *const c_char,
    depth: i32,
    enter: i64,
    exit: i64,
    peak: i64,
    nanos: i64,
    shapes: *const i64,
    nshapes: i64,
) {
    // SAFETY: ctx is the Vec `stop` passes; name is NUL-terminated and shapes holds nshapes
    // values, both alive for the call.
    let out = unsafe { &mut *(ctx as *mut Vec<OpEvent>) };
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    let flat = if nshapes == 0 {
        &[][..]
    } else {
        unsafe { std::slice::from_raw_parts(shapes, nshapes as usize) }
    };
    out.push(OpEvent {
        name,
        depth: depth.max(0) as u32,
        enter,
        exit,
        peak,
        seconds: nanos as f64 * 1e-9,
        inputs: decode_shapes(flat),
        codes: flat.to_vec(),
    });
}

/// `[dtype, ndim, sizes..., strides...]` per tensor input, `[-1]` per other input.
fn decode_shapes(mut flat: &[i64]) -> Vec<Option<(Kind, Vec<i64>)>> {
    let mut out = Vec::new();
    while let Some((&dtype, rest)) = flat.split_first() {
        if dtype < 0 {
            out.push(None);
            flat = rest;
            continue;
        }
        let ndim = rest.first().copied().unwrap_or(0).max(0) as usize;
        let sizes = rest.get(1..1 + ndim).unwrap_or_default().to_vec();
        out.push(kind_of(dtype).map(|k| (k, sizes)));
        flat = rest.get(1 + 2 * ndim..).unwrap_or_default();
    }
    out
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
/// step's reads of values. Each call must
/// leave the same bytes behind; where their peaks differ, the difference is returned. `Err`
/// names the first call that is not the same in both.
pub fn line_up(real: &[OpEvent], fake: &[OpEvent]) -> Result<Vec<PeakDifference>, String> {
    // A real step reads values (the loss) that a fake one has not: those reads allocate nothing.
    let read = |e: &OpEvent| e.name == "aten::item" || e.name == "aten::_local_scalar_dense";
    let top = |t: &[OpEvent]| -> Vec<usize> { (0..t.len()).filter(|&i| t[i].depth == 0 && !read(&t[i])).collect() };
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

/// Whether an event is a dispatcher operator (not an autograd node's evaluation or a scope).
fn is_operator(e: &OpEvent) -> bool {
    e.name.contains("::") && !e.name.starts_with("autograd::") && !e.name.starts_with("ckptune::")
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
