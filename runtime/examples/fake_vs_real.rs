//! Lines up a real CPU step and a fake (meta) step of a built-in model op by op and prints the
//! calls whose bytes differ, with the innermost real operator at the difference:
//! `cargo run --example fake_vs_real -- tiny-bert fp32 none|all [eager|sdpa] [seq] [batch]` (seq 16
//! and batch 2 by default; a batch of 1 pads nothing).

use ckptune_kernels::optrace;
use ckptune_models::{builtin, Attention, Granularity, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().map_or("tiny-bert", String::as_str).to_string();
    let precision: Precision = args.get(1).map_or("fp32", String::as_str).parse().unwrap();
    let all = args.get(2).is_some_and(|a| a == "all");
    let attention = args.get(3).map(|a| Attention::from_hf_name(a).expect("eager or sdpa"));
    let seq: i64 = args.get(4).map_or(16, |s| s.parse().expect("a sequence length"));
    let batch: i64 = args.get(5).map_or(2, |s| s.parse().expect("a batch size"));
    tch::set_num_threads(1);
    ckptune_kernels::meter::install().unwrap();
    let resnet = model.contains("resnet");
    let opts = ModelOptions {
        seq: (!resnet).then_some(seq),
        image: resnet.then_some(32),
        granularity: Granularity::Layer,
        attention,
        ..Default::default()
    };
    let cfg = TrainConfig::new(precision, OptimizerKind::AdamW, batch);
    let build = || builtin(&model, &opts).map_err(|e| ckptune_runtime::RuntimeError::Invalid(e.to_string()));
    let trace = |mut s: Session| {
        let ckpt = if all {
            s.chain.every_candidate()
        } else {
            vec![false; s.chain.units()]
        };
        s.op_trace(&ckpt).unwrap()
    };
    tch::manual_seed(0);
    let real = trace(Session::new(build().unwrap(), cfg.clone(), Device::Cpu).unwrap());
    tch::manual_seed(0);
    let fake = trace(Session::new_fake(build, cfg, Device::Cpu).unwrap());
    match optrace::line_up(&real, &fake) {
        Ok(d) if d.is_empty() => println!("the same bytes, call for call"),
        Ok(d) => d.iter().for_each(|d| println!("{d:?}")),
        Err(e) => {
            println!("{e}");
            let top = |t: &[optrace::OpEvent]| -> Vec<String> {
                t.iter()
                    .filter(|e| e.depth == 0)
                    .map(|e| format!("{} {}", e.name, e.exit - e.enter))
                    .collect()
            };
            for (a, b) in top(&real).iter().zip(top(&fake)) {
                println!("{} {a:<60} {b}", if *a == b { " " } else { "*" });
            }
        }
    }
}
