//! The kernels the calibration times apart because they run slower than their bytes at an
//! add's rate: each probe's input shape, its forward and the operators its forward and backward
//! measure (`Run::probes` in calibrate.rs times them).

use ckptune_solver::rates::Dtype;
use tch::{Device, Kind, Tensor};

use crate::error::{torch, Result};

/// The tensor kind of a calibration dtype.
pub(super) fn kind(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::Fp32 => Kind::Float,
        Dtype::Bf16 => Kind::BFloat16,
        Dtype::Fp16 => Kind::Half,
    }
}

/// Normal values of `shape` in `dtype`: the calibration's inputs.
pub(super) fn randn(shape: &[i64], dtype: Dtype) -> Result<Tensor> {
    Tensor::f_randn(shape, (kind(dtype), Device::Cpu)).map_err(torch("calibration: randn"))
}

/// A probe: an input's shape, a forward over it in grad mode, and the operators whose rates
/// its forward and backward measure; and a shape of a few elements its setup is measured on.
pub(super) struct Probe {
    pub(super) shape: &'static [i64],
    pub(super) tiny: &'static [i64],
    pub(super) forward: fn(&Tensor) -> Result<Tensor>,
    pub(super) ops: &'static [&'static str],
    /// Its input's values are made positive first, outside the timing (a square root of a
    /// negative number is a NaN, which the kernel takes a slow path for).
    pub(super) positive: bool,
}

impl Probe {
    /// Normal values of `shape` in `dtype`, positive where the probe wants them.
    pub(super) fn input(&self, shape: &[i64], dtype: Dtype) -> Result<Tensor> {
        let x = randn(shape, dtype)?;
        if self.positive {
            x.f_abs().map_err(torch("calibration: abs"))
        } else {
            Ok(x)
        }
    }
}

/// Kernels that run slower than their bytes at an add's rate (windowed, reducing, gathering, random,
/// transcendental), each timed forward and backward on a typical shape (ResNet-50's, BERT's and
/// GPT-2's at batch 8).
pub(super) const PROBES: [Probe; 11] = [
    Probe {
        shape: &[8, 128, 56, 56],
        tiny: &[2, 128, 1, 1],
        forward: |x| {
            let c = Tensor::f_ones([128], (Kind::Float, Device::Cpu)).map_err(torch("calibration: ones"))?;
            x.f_batch_norm(
                Some(&c),
                Some(&c),
                Some(&c.copy()),
                Some(&c.copy()),
                true,
                0.1,
                1e-5,
                false,
            )
            .map_err(torch("calibration: batch_norm"))
        },
        ops: &["aten::native_batch_norm", "aten::native_batch_norm_backward"],
        positive: false,
    },
    Probe {
        shape: &[8, 64, 112, 112],
        tiny: &[1, 1, 4, 4],
        forward: |x| {
            x.f_max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false)
                .map_err(torch("calibration: max_pool2d"))
        },
        ops: &[
            "aten::max_pool2d_with_indices",
            "aten::max_pool2d_with_indices_backward",
        ],
        positive: false,
    },
    Probe {
        shape: &[1024, 768],
        tiny: &[1, 768],
        forward: |x| {
            x.f_layer_norm([768], None::<&Tensor>, None::<&Tensor>, 1e-5, false)
                .map_err(torch("calibration: layer_norm"))
        },
        ops: &["aten::native_layer_norm", "aten::native_layer_norm_backward"],
        positive: false,
    },
    Probe {
        shape: &[8, 12, 128, 128],
        tiny: &[1, 1, 1, 8],
        forward: |x| x.f_softmax(-1, x.kind()).map_err(torch("calibration: softmax")),
        ops: &["aten::_softmax", "aten::_softmax_backward_data"],
        positive: false,
    },
    Probe {
        shape: &[1024, 8192],
        tiny: &[1, 8],
        forward: |x| x.f_log_softmax(-1, x.kind()).map_err(torch("calibration: log_softmax")),
        ops: &["aten::_log_softmax", "aten::_log_softmax_backward_data"],
        positive: false,
    },
    Probe {
        shape: &[1024, 3072],
        tiny: &[1, 8],
        forward: |x| x.f_gelu("none").map_err(torch("calibration: gelu")),
        ops: &["aten::gelu", "aten::gelu_backward"],
        positive: false,
    },
    Probe {
        shape: &[1024, 3072],
        tiny: &[1, 8],
        forward: |x| x.f_tanh().map_err(torch("calibration: tanh")),
        ops: &["aten::tanh", "aten::tanh_backward"],
        positive: false,
    },
    Probe {
        shape: &[1024, 2048],
        tiny: &[1, 8],
        forward: |x| x.f_silu().map_err(torch("calibration: silu")),
        ops: &["aten::silu", "aten::silu_backward"],
        positive: false,
    },
    Probe {
        shape: &[1024, 3072],
        tiny: &[1, 8],
        forward: |x| x.f_dropout(0.1, true).map_err(torch("calibration: dropout")),
        ops: &["aten::bernoulli_"],
        positive: false,
    },
    // A language model's embedding: a batch's rows gathered from a vocabulary beyond the
    // caches, and its gradient, the whole table zeroed then the rows added in. At an add's rate
    // the gather was estimated at 0.10 ms where BERT-base's took 0.45 ms in a traced step (AMD
    // EPYC, two threads): each row is a cache and TLB miss, not a stream. Fresh token ids each
    // call, as each step's batch has.
    Probe {
        shape: &[30522, 768],
        tiny: &[16, 8],
        forward: |w| {
            let ids = Tensor::f_randint(w.size()[0], [8, 128], (Kind::Int64, Device::Cpu))
                .map_err(torch("calibration: randint"))?;
            Tensor::f_embedding(w, &ids, -1, false, false).map_err(torch("calibration: embedding"))
        },
        ops: &["aten::index_select", "aten::embedding_dense_backward"],
        positive: false,
    },
    // AdamW's square root of every parameter's second moment, which runs at its compute where
    // the parameter fits a cache: on an AMD EPYC, over BERT-base's parameters, 0.080 s a step
    // against 0.039 s at an add's rate, where the division after it ran at the add's.
    Probe {
        shape: &[768, 3072],
        tiny: &[1, 8],
        forward: |x| x.f_sqrt().map_err(torch("calibration: sqrt")),
        ops: &["aten::sqrt"],
        positive: true,
    },
];
