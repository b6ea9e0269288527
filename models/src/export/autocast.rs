//! What torch.export fixed while it traced in fp32 and autocast changes: a program runs under
//! bf16 autocast as eager PyTorch would, where the traced code read a dtype from a tensor that
//! autocast makes bf16 (a projection's output).

use ckptune_kernels::autocast::is_enabled;
use ckptune_kernels::ops::Arg;
use tch::{Device, Kind};

use crate::layers::finfo_min;

/// The guard torch.export writes before a `.to(dtype)` that was a no-op when it traced: it
/// asserts the input still has the traced dtype, and the `aten::to` after it stays in the graph.
const ASSERT_METADATA: &str = "aten::_assert_tensor_metadata";

/// Whether autocast is on in this thread, for the CPU or CUDA.
pub(super) fn on() -> bool {
    is_enabled(Device::Cpu) || is_enabled(Device::Cuda(0))
}

/// Whether a call of operator `name` is skipped under autocast. A step's bf16 outputs meet the
/// traced fp32 dtypes of the guards before no-op casts (Qwen3's `q_norm` of a projection,
/// Gemma-2's norms of attention's output), and eager PyTorch runs such a `.to(dtype)` as a
/// cast: skipping the guard lets the graph's `aten::to` cast as eager does.
pub(super) fn skipped(name: &str) -> bool {
    name == ASSERT_METADATA && on()
}

/// Under autocast, a `value` traced as fp32's extreme (`torch.finfo(x.dtype).min` read from an
/// fp32 tensor, as DeBERTa masks its scores) becomes the extreme of the bf16 or fp16 tensor it
/// fills, which eager PyTorch reads from the tensor autocast made: fp32's does not fit in either,
/// and `masked_fill` refuses it.
pub(super) fn fit_extremes(args: &mut [(&str, Arg<'_>)]) {
    if !on() {
        return;
    }
    let kind = args.iter().find_map(|(n, a)| match a {
        Arg::Tensor(t) if *n == "self" => Some(t.kind()),
        _ => None,
    });
    let max = match kind {
        Some(k @ (Kind::BFloat16 | Kind::Half)) => -finfo_min(k),
        _ => return,
    };
    for (n, a) in args.iter_mut() {
        if let (&mut "value", Arg::Float(v)) = (n, a) {
            if v.abs() == f64::from(f32::MAX) {
                *v = max.copysign(*v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckptune_kernels::autocast::AutocastGuard;
    use tch::Tensor;

    #[test]
    fn the_extremes_are_the_finfo_of_torch() {
        // torch.finfo(torch.bfloat16).max and torch.finfo(torch.float16).max, as tensors hold them.
        let bf16_max = -finfo_min(Kind::BFloat16);
        let bf16 = Tensor::from(bf16_max).to_kind(Kind::BFloat16);
        assert_eq!(bf16.double_value(&[]), bf16_max);
        assert!(bf16.isfinite().int64_value(&[]) == 1);
        assert_eq!(
            Tensor::from(65504.0).to_kind(Kind::Half).double_value(&[]),
            -finfo_min(Kind::Half)
        );
    }

    #[test]
    fn fp32_extremes_fit_a_bf16_tensor_under_autocast_only() {
        let x = Tensor::zeros([2], (Kind::BFloat16, Device::Cpu));
        let fp32_min = f64::from(f32::MIN);
        let call = |v: f64| {
            let mut args = vec![("self", Arg::Tensor(&x)), ("value", Arg::Float(v))];
            fit_extremes(&mut args);
            match args[1].1 {
                Arg::Float(f) => f,
                _ => unreachable!(),
            }
        };
        assert_eq!(call(fp32_min), fp32_min, "autocast off: the traced value");
        let _on = AutocastGuard::new(Device::Cpu, Kind::BFloat16, true).unwrap();
        assert_eq!(call(fp32_min), finfo_min(Kind::BFloat16));
        assert_eq!(call(-fp32_min), -finfo_min(Kind::BFloat16));
        // Any other value is the program's own.
        assert_eq!(call(-1e4), -1e4);
        assert!(skipped(ASSERT_METADATA) && !skipped("aten::to"));
    }
}
