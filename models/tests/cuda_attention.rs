//! CUDA's memory-efficient attention traced on the meta device against what it allocated on an
//! H200 (kernels/tests/fixtures/efficient_attention_h200.json: the allocator's history of
//! PyTorch's SDPA, forward and backward, with the inputs made as a transformer makes them).

use ckptune_kernels::alloc_log::{history, AllocEvent, Recording};
use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::fake::FakeMode;
use ckptune_kernels::meter;
use ckptune_kernels::optrace::{self, OpEvent};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use ckptune_models::cuda_efficient_attention as cuda_efficient;

fn expected<'a>(case: &'a Value, key: &str) -> Vec<(&'a str, u64)> {
    case[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_str().unwrap(), e[1].as_u64().unwrap()))
        .collect()
}

/// q, k, v as `[b, h, s, d]` views of `[b, s, h*d]` leaves that need gradients, and the
/// padding mask of the fixture (the last quarter of every other sequence padded).
fn inputs(b: i64, h: i64, s: i64, d: i64, mask: bool) -> (Vec<Tensor>, Option<Tensor>) {
    let leaves: Vec<Tensor> = (0..3)
        .map(|_| Tensor::zeros([b, s, h * d], (Kind::Float, Device::Cpu)).set_requires_grad(true))
        .collect();
    let mask = mask.then(|| {
        let pad = Tensor::ones([b, s], (Kind::Bool, Device::Cpu));
        let _ = pad.slice(0, 1, b, 2).slice(1, s - s / 4, s, 1).fill_(0);
        pad.view([b, 1, 1, s]).expand([b, 1, s, s], false).contiguous()
    });
    (leaves, mask)
}

#[test]
fn efficient_attention_allocates_what_the_gpu_did() {
    // The allocation log is process-wide: the other test's steps must not land in it.
    let _lock = meter::exclusive();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kernels/tests/fixtures/efficient_attention_h200.json"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases: Vec<&Value> = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["choice"] == 2)
        .collect();
    assert!(cases.len() >= 5, "the fixture's fp32 cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let s: Vec<i64> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        let (b, h, seq, d) = (s[0], s[1], s[2], s[3]);
        let fake = FakeMode::enter().unwrap();
        let (leaves, mask) = inputs(b, h, seq, d, case["mask"].as_bool().unwrap());
        let qkv: Vec<Tensor> = leaves.iter().map(|x| x.view([b, seq, h, d]).transpose(1, 2)).collect();
        let p = case["p"].as_f64().unwrap();
        let causal = case["causal"].as_bool().unwrap();
        // The fixture's gradient, made before its history started, laid out as the output is.
        let grad = Tensor::empty([b, seq, h, d], (Kind::Float, Device::Cpu)).transpose(1, 2);
        // One recording, so that backward's frees of what forward saved are events too.
        let mut rec = Recording::start().unwrap();
        let out = cuda_efficient(
            &qkv[0],
            &qkv[1],
            &qkv[2],
            mask.as_ref(),
            p,
            causal,
            (d as f64).powf(-0.5),
        );
        rec.mark("backward");
        ckptune_kernels::autograd::backward(out.shallow_clone(), grad.shallow_clone()).unwrap();
        let log = rec.finish().events;
        let split = log.iter().position(|e| matches!(e, AllocEvent::Mark(_))).unwrap();
        let all = history(&log);
        let forward_len = history(&log[..split]).len();
        let (forward, backward) = (all[..forward_len].to_vec(), all[forward_len..].to_vec());
        drop((out, grad, qkv, leaves, mask));
        drop(fake);
        assert_eq!(forward, expected(case, "forward"), "{name}: forward");
        assert_eq!(backward, expected(case, "backward"), "{name}: backward");
    }
}

/// The casts made before the attention kernel (`aten::_to_copy` at any depth, each as its
/// input's and output's dtype and sizes) and the dtypes of the tensors the kernel received.
type Casts = (Vec<(Kind, Vec<i64>, Kind)>, Vec<Kind>);

fn casts_before(events: &[OpEvent], kernel: &str) -> Casts {
    let at = events
        .iter()
        .position(|e| e.name == kernel)
        .unwrap_or_else(|| panic!("{kernel} ran"));
    let casts = events[..at]
        .iter()
        .filter(|e| e.name == "aten::_to_copy")
        .map(|e| {
            let (kind, sizes) = e.inputs[0].clone().unwrap();
            (kind, sizes, e.outputs[0].as_ref().unwrap().0)
        })
        .collect();
    let kinds = events[at].inputs.iter().flatten().map(|(k, _)| *k).collect();
    (casts, kinds)
}

/// Inside an autocast region, the efficient kernel gets what libtorch's own autocast hands
/// SDPA: every floating input (a float mask among them) cast to the region's dtype, in order,
/// and nothing else cast. The reference is libtorch: the same call through
/// `scaled_dot_product_attention` under CPU autocast, whose casts autocast makes (the policy is
/// the same on CUDA: a bf16 step on an H200 casts a Llama's f32 rotated query and repeated key
/// before its attention, as `scripts/autocast_census.py` records).
#[test]
fn efficient_attention_under_autocast_casts_its_inputs_as_autocast_does() {
    let _lock = meter::exclusive();
    let (b, h, s, d) = (2, 4, 16, 8);
    let cases: [(&str, [Kind; 3], Option<Kind>); 4] = [
        (
            "f32 query and key, bf16 value",
            [Kind::Float, Kind::Float, Kind::BFloat16],
            None,
        ),
        ("all f32, f32 additive mask", [Kind::Float; 3], Some(Kind::Float)),
        ("all bf16, boolean mask", [Kind::BFloat16; 3], Some(Kind::Bool)),
        ("all f32, boolean mask", [Kind::Float; 3], Some(Kind::Bool)),
    ];
    for (name, kinds, mask_kind) in cases {
        let run = |efficient: bool| {
            let _fake = FakeMode::enter().unwrap();
            let qkv: Vec<Tensor> = kinds
                .iter()
                .map(|&k| Tensor::zeros([b, h, s, d], (k, Device::Cpu)).set_requires_grad(true))
                .collect();
            let mask = mask_kind.map(|k| Tensor::zeros([b, 1, s, s], (k, Device::Cpu)));
            optrace::start().unwrap();
            let out = {
                let _ac = AutocastGuard::new(Device::Cpu, Kind::BFloat16, true).unwrap();
                if efficient {
                    cuda_efficient(&qkv[0], &qkv[1], &qkv[2], mask.as_ref(), 0.0, false, 0.5)
                } else {
                    Tensor::scaled_dot_product_attention(
                        &qkv[0],
                        &qkv[1],
                        &qkv[2],
                        mask.as_ref(),
                        0.0,
                        false,
                        0.5,
                        false,
                    )
                }
            };
            let events = optrace::stop().unwrap();
            (out.kind(), events)
        };
        let (ours_kind, ours) = run(true);
        let (torch_kind, torch) = run(false);
        assert_eq!(ours_kind, torch_kind, "{name}: output dtype");
        assert_eq!(
            casts_before(&ours, "aten::_scaled_dot_product_efficient_attention"),
            casts_before(&torch, "aten::_scaled_dot_product_flash_attention_for_cpu"),
            "{name}"
        );
    }
}
