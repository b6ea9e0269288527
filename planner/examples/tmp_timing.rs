use ckptune::chain_model::peak_of;
use ckptune::solver::*;
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args[0].parse().unwrap();
    let engine = match args.get(1).map(|s| s.as_str()) {
        Some("milp") => Engine::Milp,
        Some("dp") => Engine::Dp,
        _ => Engine::Auto,
    };
    let opts = SolveOptions {
        engine,
        ..Default::default()
    };
    let problems: Vec<ConfigProblem> = (0..12).map(|s| synthetic_problem(n, s)).collect();
    for f in [0.1, 0.3, 0.6, 0.9] {
        // One budget for all configs: the median of each config's point at fraction f.
        let mut pts: Vec<i64> = problems
            .iter()
            .map(|p| {
                let lo = min_peak(p).unwrap().peak;
                let hi = peak_of(&p.moments, &vec![false; n]).unwrap().0;
                lo + ((hi - lo) as f64 * f) as i64
            })
            .collect();
        pts.sort();
        let budget = pts[6];
        let t = Instant::now();
        let plan = solve_with(&problems, budget, opts);
        let el = t.elapsed().as_secs_f64();
        let t2 = Instant::now();
        for p in &problems {
            let _ = solve_config_with(p, budget, opts).unwrap();
        }
        let serial = t2.elapsed().as_secs_f64();
        match plan {
            Ok(plan) => println!(
                "n {n} f {f}: solve() {el:.3}s (serial {serial:.3}s), feasible {}/12, best {} k{}",
                plan.configs.iter().filter(|c| c.status == SolveStatus::Optimal).count(),
                plan.chosen().key,
                plan.chosen().x.iter().filter(|&&v| v).count()
            ),
            Err(e) => println!("n {n} f {f}: {el:.3}s err {e}"),
        }
    }
}
