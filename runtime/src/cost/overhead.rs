//! The time a call costs beyond its work: a small training step of the operators a real step
//! calls, on tensors of a few elements (so their work is nil), over its calls.
//!
//! The step is varied on purpose. A tight loop of two operators on one element stays in the
//! core's instruction and branch caches, while a real step spreads its calls over a few dozen
//! operators and their autograd nodes. On the benchmark's CPU, on a busy machine: the loop took
//! 2.3-2.5 µs per call, this step 3.7-4.0 µs, and tiny-ResNet's step 3.8-5.8 µs per call beyond
//! its estimated work.

use ckptune_kernels::autograd;
use ckptune_solver::rates::Work;
use tch::{Device, Kind, Reduction, TchError, Tensor};

use super::timed::{time_call, traced};
use crate::error::{torch, Result};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

/// What the step trains: a tiny transformer layer's and a tiny convolution stage's parameters,
/// each with AdamW's two moments.
struct Tiny {
    tokens: Tensor,
    targets: Tensor,
    image: Tensor,
    embedding: Tensor,
    linear: [Tensor; 4],
    norm: [Tensor; 2],
    conv: Tensor,
    batch_norm: [Tensor; 2],
    moments: Vec<(Tensor, Tensor)>,
}

fn param(shape: &[i64]) -> Result<Tensor> {
    Ok(Tensor::f_randn(shape, F32)
        .map_err(torch("calibration: randn"))?
        .set_requires_grad(true))
}

impl Tiny {
    fn new() -> Result<Tiny> {
        let tokens =
            Tensor::f_randint(16, [2, 4], (Kind::Int64, Device::Cpu)).map_err(torch("calibration: randint"))?;
        let mut t = Tiny {
            targets: tokens.shallow_clone(),
            tokens,
            image: Tensor::f_randn([2, 2, 4, 4], F32).map_err(torch("calibration: randn"))?,
            embedding: param(&[16, 8])?,
            linear: [param(&[8, 8])?, param(&[8])?, param(&[16, 8])?, param(&[16])?],
            norm: [param(&[8])?, param(&[8])?],
            conv: param(&[4, 2, 3, 3])?,
            batch_norm: [param(&[4])?, param(&[4])?],
            moments: Vec::new(),
        };
        t.moments = t
            .params()
            .into_iter()
            .map(|p| Ok((p.f_zeros_like()?, p.f_zeros_like()?)))
            .collect::<Result<_, TchError>>()
            .map_err(torch("calibration: zeros_like"))?;
        Ok(t)
    }

    fn params(&self) -> Vec<&Tensor> {
        let mut ps = vec![&self.embedding, &self.conv];
        ps.extend(self.linear.iter().chain(&self.norm).chain(&self.batch_norm));
        ps
    }

    /// Embedding, attention, layer norm, GELU, products and a cross-entropy loss; a
    /// convolution, batch norm, ReLU and pooling; both losses summed.
    fn loss(&self) -> Result<Tensor, TchError> {
        let [w1, b1, w2, b2] = &self.linear;
        let x = Tensor::f_embedding(&self.embedding, &self.tokens, -1, false, false)?;
        let q = x.f_unsqueeze(1)?;
        let a = Tensor::f_scaled_dot_product_attention(&q, &q, &q, None::<&Tensor>, 0.0, true, None::<f64>, false)?;
        let h = (&x + a.f_squeeze_dim(1)?).f_layer_norm([8], Some(&self.norm[0]), Some(&self.norm[1]), 1e-5, false)?;
        let logits = h.f_linear(w1, Some(b1))?.f_gelu("none")?.f_linear(w2, Some(b2))?;
        let text = logits.f_view([-1, 16])?.f_cross_entropy_loss::<Tensor>(
            &self.targets.f_view([-1])?,
            None,
            Reduction::Mean,
            -100,
            0.0,
        )?;
        let [g, b] = &self.batch_norm;
        let c = self
            .image
            .f_conv2d(&self.conv, None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1)?;
        let c = Tensor::f_batch_norm(
            &c,
            Some(g),
            Some(b),
            None::<&Tensor>,
            None::<&Tensor>,
            true,
            0.1,
            1e-5,
            false,
        )?;
        let c = c.f_relu()?.f_max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false)?;
        text.f_add(&c.f_mean(Kind::Float)?)
    }

    /// AdamW's update of every parameter as `_single_tensor_adam` makes it (the runtime's
    /// `optim`), gradients then zeroed.
    fn update(&self) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        for (p, (m, v)) in self.params().into_iter().zip(&self.moments) {
            let (mut p, mut m, mut v, mut g) = (p.shallow_clone(), m.shallow_clone(), v.shallow_clone(), p.grad());
            let _ = p.f_mul_scalar_(0.99)?;
            let _ = m.f_lerp_(&g, 0.1)?;
            let _ = v.f_mul_scalar_(0.999)?.f_addcmul_(&g, &g)?;
            let denom = v.f_sqrt()?.f_div_scalar(0.5)?.f_add_scalar_(1e-8)?;
            let _ = p.f_addcdiv_(&m, &denom)?;
            let _ = g.f_zero_()?;
        }
        Ok(())
    }

    fn step(&self) -> Result<Tensor> {
        let loss = self.loss().map_err(torch("calibration: small step's forward"))?;
        let one = loss.f_ones_like().map_err(torch("calibration: ones_like"))?;
        autograd::backward(loss.shallow_clone(), one)?;
        self.update().map_err(torch("calibration: small step's AdamW update"))?;
        Ok(loss)
    }
}

/// Seconds per call of the tiny step: its time less the `setup` of each operator that does work
/// (by its name and work: a convolution's through oneDNN, batch norm's, timed apart) over the
/// calls that pay the overhead.
pub(super) fn per_call(setup: &dyn Fn(&str, &Work) -> f64) -> Result<f64> {
    let tiny = Tiny::new()?;
    let mut step = || tiny.step();
    let traced = traced(&mut step)?;
    let setups: f64 = traced.counted.iter().map(|(op, c)| setup(op, &c.work)).sum();
    let t = time_call(step)?;
    Ok((t - setups).max(0.2 * t) / traced.calls.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::work;
    use ckptune_kernels::optrace;

    #[test]
    fn the_small_step_calls_the_operators_of_a_training_step() {
        // Alone, with the meter installed first: calibrate.rs's tests say why.
        let _lock = ckptune_kernels::meter::exclusive();
        ckptune_kernels::meter::install().unwrap();
        let tiny = Tiny::new().unwrap();
        let before = tiny.embedding.copy();
        optrace::start().unwrap();
        let loss = tiny.step().unwrap();
        let events = optrace::stop().unwrap();
        assert!(loss.double_value(&[]).is_finite());
        let names: std::collections::BTreeSet<&str> = events.iter().map(|e| work::base(&e.name)).collect();
        for op in [
            "aten::embedding",
            "aten::scaled_dot_product_attention",
            "aten::layer_norm",
            "aten::gelu",
            "aten::cross_entropy_loss",
            "aten::conv2d",
            "aten::batch_norm",
            "aten::max_pool2d",
            "aten::lerp_",
            "aten::addcmul_",
            "aten::addcdiv_",
            "autograd::engine::evaluate_function: ConvolutionBackward0",
        ] {
            assert!(names.contains(op), "the small step does not call {op}: {names:?}");
        }
        // AdamW moved every parameter and left its gradient zeroed for the next step.
        assert_ne!(tiny.embedding, before);
        for p in tiny.params() {
            assert_eq!(p.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
        }
    }
}
