use ckptune_models::{builtin, Granularity, ModelOptions};
use ckptune_runtime::{OptimizerKind, Precision, Session, TrainConfig};
use tch::Device;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().map_or("tiny-bert", String::as_str).to_string();
    let precision: Precision = args.get(1).map_or("fp32", String::as_str).parse().unwrap();
    let fake = args.get(2).is_some_and(|a| a == "fake");
    let all = args.get(3).is_some_and(|a| a == "all");
    tch::set_num_threads(1);
    ckptune_kernels::meter::install().unwrap();
    let resnet = model.contains("resnet");
    let opts = ModelOptions { seq: (!resnet).then_some(16), image: resnet.then_some(32), granularity: Granularity::Layer, ..Default::default() };
    let cfg = TrainConfig::new(precision, OptimizerKind::AdamW, 2);
    let build = || builtin(&model, &opts).map_err(|e| ckptune_runtime::RuntimeError::Invalid(e.to_string()));
    tch::manual_seed(0);
    let mut s = if fake { Session::new_fake(build, cfg, Device::Cpu).unwrap() } else { Session::new(build().unwrap(), cfg, Device::Cpu).unwrap() };
    let ckpt = if all { s.chain.every_candidate() } else { vec![false; s.chain.units()] };
    let t = s.op_trace(&ckpt).unwrap();
    for e in &t {
        let ins: Vec<String> = e.inputs.iter().map(|i| match i { Some((k, s)) => format!("{:?}{:?}", k, s), None => "_".into() }).collect();
        let outs: Vec<String> = e.outputs.iter().map(|i| match i { Some((k, s)) => format!("{:?}{:?}", k, s), None => "_".into() }).collect(); println!("{}{}{} {:.1}us {} -> {} {:?}", "  ".repeat(e.depth as usize), if e.scope {"SCOPE "} else {""}, e.name, e.seconds*1e6, ins.join(" "), outs.join(" "), e.numbers.iter().flatten().collect::<Vec<_>>());
    }
}
