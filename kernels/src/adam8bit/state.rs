//! One parameter's optimizer state: its moments as libtorch tensors on the parameter's device
//! (8-bit codes with one absmax per block, or 32-bit below the threshold), and their size.

use tch::{Device, Kind, Tensor};

use super::qmap::BLOCK;
use super::qmap::{dequantize_blockwise, SIGNED, UNSIGNED};
use crate::KernelError;

/// Tensors with fewer elements keep 32-bit moments (bitsandbytes' `min_8bit_size` default): their
/// state is negligible, and they are biases and norm scales, which a 2048-element block would
/// barely fill.
pub const MIN_8BIT_NUMEL: i64 = 4096;

/// Bytes of optimizer state for a parameter of `numel` elements: 8-bit codes for both moments
/// plus two f32 absmax per block, or two f32 moments below [`MIN_8BIT_NUMEL`].
pub fn state_bytes_for(numel: i64) -> i64 {
    if numel < MIN_8BIT_NUMEL {
        2 * 4 * numel
    } else {
        2 * numel + 2 * 4 * blocks_of(numel)
    }
}

/// Quantization blocks of a tensor of `numel` (≥ 0) elements.
fn blocks_of(numel: i64) -> i64 {
    (numel + BLOCK as i64 - 1) / BLOCK as i64
}

/// One parameter's moments.
#[derive(Debug)]
pub enum Moments {
    /// 32-bit moments (small tensors), flat f32.
    Full { m: Tensor, v: Tensor },
    /// 8-bit codes (flat uint8) and one f32 absmax per block for each moment.
    Blockwise {
        m_codes: Tensor,
        v_codes: Tensor,
        m_absmax: Tensor,
        v_absmax: Tensor,
    },
}

/// One parameter's optimizer state.
#[derive(Debug)]
pub struct ParamState {
    /// Updates applied so far (PyTorch's per-parameter `state['step']`).
    pub step: u64,
    pub moments: Moments,
}

pub(super) fn torch_err(op: &'static str) -> impl Fn(tch::TchError) -> KernelError {
    move |e| KernelError::Torch {
        op,
        message: crate::ffi::first_line(&e.to_string()),
    }
}

impl ParamState {
    /// Zero state for a parameter of `numel` elements on `device`.
    pub fn zeros(numel: i64, device: Device) -> Result<Self, KernelError> {
        let op = "allocating 8-bit Adam state";
        let e = torch_err(op);
        let moments = if numel < MIN_8BIT_NUMEL {
            Moments::Full {
                m: Tensor::f_zeros([numel], (Kind::Float, device)).map_err(&e)?,
                v: Tensor::f_zeros([numel], (Kind::Float, device)).map_err(&e)?,
            }
        } else {
            let blocks = blocks_of(numel);
            Moments::Blockwise {
                m_codes: Tensor::f_full([numel], i64::from(SIGNED.zero), (Kind::Uint8, device)).map_err(&e)?,
                v_codes: Tensor::f_full([numel], i64::from(UNSIGNED.zero), (Kind::Uint8, device)).map_err(&e)?,
                m_absmax: Tensor::f_zeros([blocks], (Kind::Float, device)).map_err(&e)?,
                v_absmax: Tensor::f_zeros([blocks], (Kind::Float, device)).map_err(&e)?,
            }
        };
        Ok(Self { step: 0, moments })
    }

    /// Bytes of the state's tensors.
    pub fn bytes(&self) -> i64 {
        let b = |t: &Tensor| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        match &self.moments {
            Moments::Full { m, v } => b(m) + b(v),
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => b(m_codes) + b(v_codes) + b(m_absmax) + b(v_absmax),
        }
    }

    /// Both moments as f32 on the CPU (dequantized where 8-bit), for inspection and tests.
    pub fn moments_f32(&self) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let e = torch_err("reading 8-bit Adam state");
        let f32s = |t: &Tensor| -> Result<Vec<f32>, KernelError> {
            Vec::<f32>::try_from(&t.f_to_device(Device::Cpu).map_err(&e)?).map_err(&e)
        };
        let u8s = |t: &Tensor| -> Result<Vec<u8>, KernelError> {
            Vec::<u8>::try_from(&t.f_to_device(Device::Cpu).map_err(&e)?).map_err(&e)
        };
        match &self.moments {
            Moments::Full { m, v } => Ok((f32s(m)?, f32s(v)?)),
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => {
                let (mc, vc) = (u8s(m_codes)?, u8s(v_codes)?);
                let (mut m, mut v) = (vec![0f32; mc.len()], vec![0f32; vc.len()]);
                dequantize_blockwise(&mc, &f32s(m_absmax)?, &SIGNED, &mut m)?;
                dequantize_blockwise(&vc, &f32s(v_absmax)?, &UNSIGNED, &mut v)?;
                Ok((m, v))
            }
        }
    }
}
