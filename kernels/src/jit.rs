//! TorchScript modules with access to their children, which tch's `CModule` lacks: a scripted
//! or traced model whose top-level children form a chain can be run block by block.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;

use tch::Tensor;

use crate::{ffi, KernelError};

/// A TorchScript module (or a handle to one of its submodules, sharing its parameters).
pub struct JitModule {
    ptr: *mut ffi::CModule,
}

// SAFETY: a torch::jit::Module handle may move between threads; running one concurrently from
// several threads is not done by ckptune (no Sync).
unsafe impl Send for JitModule {}

impl Drop for JitModule {
    fn drop(&mut self) {
        unsafe { ffi::ckpt_jit_free(self.ptr) }
    }
}

extern "C" fn push_module(ctx: *mut c_void, name: *const c_char, m: *mut ffi::CModule) {
    // SAFETY: ctx is the Vec passed by `named_children` below, name a NUL-terminated string.
    let out = unsafe { &mut *(ctx as *mut Vec<(String, JitModule)>) };
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    out.push((name, JitModule { ptr: m }));
}

extern "C" fn push_tensor(ctx: *mut c_void, name: *const c_char, t: ffi::CTensor) {
    // SAFETY: as above; t is a fresh heap tensor handle.
    let out = unsafe { &mut *(ctx as *mut Vec<(String, Tensor)>) };
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    out.push((name, ffi::from_raw(t)));
}

impl JitModule {
    /// Loads a TorchScript file onto the CPU.
    pub fn load(path: &Path) -> Result<Self, KernelError> {
        let shown = path.display().to_string();
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| KernelError::JitLoad {
            path: shown.clone(),
            message: "path contains a NUL byte".into(),
        })?;
        let mut ptr = std::ptr::null_mut();
        ffi::check("loading TorchScript", |e| unsafe {
            ffi::ckpt_jit_load(c.as_ptr(), &mut ptr, e)
        })
        .map_err(|e| KernelError::JitLoad {
            path: shown,
            message: e.to_string(),
        })?;
        Ok(Self { ptr })
    }

    /// Direct children in definition order, as `named_children()` in PyTorch.
    pub fn named_children(&self) -> Result<Vec<(String, JitModule)>, KernelError> {
        let mut out: Vec<(String, JitModule)> = Vec::new();
        ffi::check("listing TorchScript children", |e| unsafe {
            ffi::ckpt_jit_named_children(self.ptr, &mut out as *mut _ as *mut c_void, push_module, e)
        })?;
        Ok(out)
    }

    /// The module's TorchScript class name (e.g. `__torch__.torchvision.models.resnet.ResNet`).
    pub fn type_name(&self) -> Result<String, KernelError> {
        let mut s: *mut c_char = std::ptr::null_mut();
        ffi::check("reading a TorchScript type name", |e| unsafe {
            ffi::ckpt_jit_type_name(self.ptr, &mut s, e)
        })?;
        Ok(ffi::take_str(s))
    }

    /// Parameters (recursively, with qualified names).
    pub fn named_parameters(&self) -> Result<Vec<(String, Tensor)>, KernelError> {
        self.named_tensors(false)
    }

    /// Buffers (recursively, with qualified names).
    pub fn named_buffers(&self) -> Result<Vec<(String, Tensor)>, KernelError> {
        self.named_tensors(true)
    }

    fn named_tensors(&self, buffers: bool) -> Result<Vec<(String, Tensor)>, KernelError> {
        let mut out: Vec<(String, Tensor)> = Vec::new();
        ffi::check("listing TorchScript tensors", |e| unsafe {
            ffi::ckpt_jit_named_parameters(
                self.ptr,
                buffers as i32,
                &mut out as *mut _ as *mut c_void,
                push_tensor,
                e,
            )
        })?;
        Ok(out)
    }

    /// Runs `forward` on tensor inputs; the module must return one tensor.
    pub fn forward(&self, inputs: &[&Tensor]) -> Result<Tensor, KernelError> {
        let ptrs: Vec<ffi::CTensor> = inputs.iter().map(|t| t.as_ptr() as ffi::CTensor).collect();
        let mut out: ffi::CTensor = std::ptr::null_mut();
        ffi::check("running a TorchScript forward", |e| unsafe {
            ffi::ckpt_jit_forward(self.ptr, ptrs.as_ptr(), ptrs.len() as i32, &mut out, e)
        })?;
        Ok(ffi::from_raw(out))
    }

    /// Training or evaluation mode, recursively.
    pub fn set_train(&self, on: bool) -> Result<(), KernelError> {
        ffi::check("setting TorchScript train mode", |e| unsafe {
            ffi::ckpt_jit_train(self.ptr, on as i32, e)
        })
    }
}
