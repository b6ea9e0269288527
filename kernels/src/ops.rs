//! Any operator libtorch's dispatcher knows, called by name with one generic boxed call: the
//! interpreter of `torch.export` programs runs every node through [`call`]. Arguments are given
//! by their schema names; the shim converts each by the schema's type (an `int` literal for a
//! `float` argument becomes a double, a `Scalar` keeps its Python type), as PyTorch's own
//! runtime for exported programs does.

use std::ffi::{c_char, c_void, CString};

use tch::Tensor;

use crate::{ffi, KernelError};

/// One argument value as an exported program writes it.
#[derive(Debug)]
pub enum Arg<'a> {
    None,
    Tensor(&'a Tensor),
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Bools(Vec<bool>),
    /// `Tensor[]` or `Tensor?[]` (a `None` entry only for the latter).
    Tensors(Vec<Option<&'a Tensor>>),
    /// A string, or a device (`"cpu"`).
    Str(String),
}

/// One returned value.
#[derive(Debug)]
pub enum Value {
    None,
    Tensor(Tensor),
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A list return (`Tensor[]`, `int[]`), element by element.
    List(Vec<Value>),
}

impl Value {
    fn tag_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Tensor(_) => "a tensor",
            Value::Int(_) => "an int",
            Value::Float(_) => "a float",
            Value::Bool(_) => "a bool",
            Value::List(_) => "a list",
        }
    }

    /// What the value is, for error messages.
    pub fn describe(&self) -> &'static str {
        self.tag_name()
    }
}

#[repr(C)]
struct CArg {
    name: *const c_char,
    tag: i32,
    i: i64,
    f: f64,
    ints: *const i64,
    floats: *const f64,
    tensors: *const ffi::CTensor,
    len: i64,
    str: *const c_char,
    tensor: ffi::CTensor,
}

extern "C" fn push_value(ctx: *mut c_void, ret: i32, item: i32, tag: i32, t: ffi::CTensor, i: i64, f: f64) {
    // SAFETY: ctx is the Vec passed by `call` below; a tensor handle is fresh and ours to own.
    let out = unsafe { &mut *(ctx as *mut Vec<Value>) };
    let v = match tag {
        1 => Value::Tensor(ffi::from_raw(t)),
        2 => Value::Int(i),
        3 => Value::Float(f),
        4 => Value::Bool(i != 0),
        5 => Value::List(Vec::with_capacity(i.max(0) as usize)),
        _ => Value::None,
    };
    let ret = ret as usize;
    if item < 0 {
        while out.len() < ret {
            out.push(Value::None);
        }
        out.push(v);
    } else if let Some(Value::List(l)) = out.get_mut(ret) {
        l.push(v);
    }
}

/// The schema of `name.overload` (`aten::conv2d`, `default` for the overload named ``), or an
/// error if the dispatcher has no such operator.
pub fn schema(name: &str, overload: &str) -> Result<String, KernelError> {
    let (n, o) = (cstring(name)?, cstring(overload)?);
    let mut s: *mut c_char = std::ptr::null_mut();
    ffi::check("looking up an operator", |e| unsafe {
        ffi::ckpt_op_schema(n.as_ptr(), o.as_ptr(), &mut s, e)
    })?;
    Ok(ffi::take_str(s))
}

/// Calls `name.overload` (`aten::conv2d`, overload `""` for `.default`) with named arguments;
/// arguments not given take the schema's defaults. Returns one value per schema return.
pub fn call(name: &str, overload: &str, args: &[(&str, Arg<'_>)]) -> Result<Vec<Value>, KernelError> {
    let (n, o) = (cstring(name)?, cstring(overload)?);
    let names: Vec<CString> = args.iter().map(|(a, _)| cstring(a)).collect::<Result<_, _>>()?;
    // Owned buffers the C structs point into; they outlive the call.
    let mut ints: Vec<Vec<i64>> = Vec::new();
    let mut strs: Vec<CString> = Vec::new();
    let mut lists: Vec<Vec<ffi::CTensor>> = Vec::new();
    for (_, a) in args {
        match a {
            Arg::Bools(b) => ints.push(b.iter().map(|&x| x as i64).collect()),
            Arg::Str(s) => strs.push(cstring(s)?),
            Arg::Tensors(ts) => lists.push(
                ts.iter()
                    .map(|t| t.map_or(std::ptr::null_mut(), |t| t.as_ptr() as ffi::CTensor))
                    .collect(),
            ),
            _ => {}
        }
    }
    let (mut bi, mut si, mut li) = (0, 0, 0);
    let cargs: Vec<CArg> = args
        .iter()
        .zip(&names)
        .map(|((_, a), name)| {
            let mut c = CArg {
                name: name.as_ptr(),
                tag: 0,
                i: 0,
                f: 0.0,
                ints: std::ptr::null(),
                floats: std::ptr::null(),
                tensors: std::ptr::null(),
                len: 0,
                str: std::ptr::null(),
                tensor: std::ptr::null_mut(),
            };
            match a {
                Arg::None => {}
                Arg::Tensor(t) => {
                    c.tag = 1;
                    c.tensor = t.as_ptr() as ffi::CTensor;
                }
                Arg::Int(i) => {
                    c.tag = 2;
                    c.i = *i;
                }
                Arg::Float(f) => {
                    c.tag = 3;
                    c.f = *f;
                }
                Arg::Bool(b) => {
                    c.tag = 4;
                    c.i = *b as i64;
                }
                Arg::Ints(v) => {
                    c.tag = 5;
                    c.ints = v.as_ptr();
                    c.len = v.len() as i64;
                }
                Arg::Floats(v) => {
                    c.tag = 6;
                    c.floats = v.as_ptr();
                    c.len = v.len() as i64;
                }
                Arg::Bools(_) => {
                    c.tag = 7;
                    c.ints = ints[bi].as_ptr();
                    c.len = ints[bi].len() as i64;
                    bi += 1;
                }
                Arg::Tensors(_) => {
                    c.tag = 8;
                    c.tensors = lists[li].as_ptr();
                    c.len = lists[li].len() as i64;
                    li += 1;
                }
                Arg::Str(_) => {
                    c.tag = 9;
                    c.str = strs[si].as_ptr();
                    si += 1;
                }
            }
            c
        })
        .collect();
    let mut out: Vec<Value> = Vec::new();
    ffi::check("calling an operator", |e| unsafe {
        ffi::ckpt_op_call(
            n.as_ptr(),
            o.as_ptr(),
            cargs.as_ptr() as *const c_void,
            cargs.len() as i32,
            &mut out as *mut _ as *mut c_void,
            push_value,
            e,
        )
    })?;
    Ok(out)
}

fn cstring(s: &str) -> Result<CString, KernelError> {
    CString::new(s).map_err(|_| KernelError::Invalid {
        op: "calling an operator",
        message: format!("{s:?} contains a NUL byte"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn boxed_call_matches_the_tch_binding() {
        let x = Tensor::randn([2, 3, 8, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([4, 3, 3, 3], (Kind::Float, Device::Cpu));
        let out = call(
            "aten::conv2d",
            "",
            &[
                ("input", Arg::Tensor(&x)),
                ("weight", Arg::Tensor(&w)),
                ("bias", Arg::None),
                ("stride", Arg::Ints(vec![2, 2])),
                ("padding", Arg::Ints(vec![1, 1])),
            ],
        )
        .unwrap();
        let Some(Value::Tensor(y)) = out.first() else {
            panic!("conv2d returned {out:?}")
        };
        let want = x.conv2d(&w, None::<Tensor>, [2, 2], [1, 1], [1, 1], 1);
        assert!(y.equal(&want));
    }

    #[test]
    fn scalars_and_lists_follow_the_schema() {
        // `add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1)` with an int alpha, and
        // `split.Tensor` returning a list.
        let a = Tensor::arange(6, (Kind::Float, Device::Cpu));
        let out = call(
            "aten::add",
            "Tensor",
            &[
                ("self", Arg::Tensor(&a)),
                ("other", Arg::Tensor(&a)),
                ("alpha", Arg::Int(2)),
            ],
        )
        .unwrap();
        let Some(Value::Tensor(y)) = out.first() else {
            panic!("{out:?}")
        };
        assert!(y.equal(&(&a * 3)));
        let out = call(
            "aten::split",
            "Tensor",
            &[("self", Arg::Tensor(&a)), ("split_size", Arg::Int(4))],
        )
        .unwrap();
        let Some(Value::List(parts)) = out.first() else {
            panic!("{out:?}")
        };
        assert_eq!(parts.len(), 2);
        let out = call(
            "aten::sym_size",
            "int",
            &[("self", Arg::Tensor(&a)), ("dim", Arg::Int(0))],
        )
        .unwrap();
        assert!(matches!(out.first(), Some(Value::Int(6))), "{out:?}");
    }

    #[test]
    fn unknown_operators_and_wrong_types_are_errors() {
        let e = schema("aten::no_such_op", "").unwrap_err().to_string();
        assert!(e.contains("no_such_op"), "{e}");
        let a = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let e = call("aten::relu", "", &[("self", Arg::Str("cpu".into()))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("argument 'self'") && e.contains("a string"), "{e}");
        // A Python number for a tensor argument is a wrapped-number tensor, as in eager.
        let b = Tensor::ones([2], (Kind::BFloat16, Device::Cpu));
        let out = call(
            "aten::add",
            "Tensor",
            &[("self", Arg::Tensor(&b)), ("other", Arg::Int(1))],
        )
        .unwrap();
        let Some(Value::Tensor(y)) = out.first() else {
            panic!("{out:?}")
        };
        assert_eq!(y.kind(), Kind::BFloat16, "a wrapped number does not promote");
        let e = call("aten::relu", "", &[("self", Arg::Tensor(&a)), ("bogus", Arg::Int(1))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = call("aten::conv2d", "", &[("input", Arg::Tensor(&a))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'weight'"), "{e}");
    }
}
