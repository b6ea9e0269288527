use ckptune::chain_model::peak_of;
use ckptune::solver::*;
use std::time::Instant;
fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let n = args[0];
    let seeds = args.get(1).copied().unwrap_or(12) as u64;
    for seed in 0..seeds {
        let p = synthetic_problem(n, seed);
        let t = Instant::now();
        let lo = min_peak(&p).unwrap();
        let tmin = t.elapsed();
        let hi = peak_of(&p.moments, &vec![false; n]).unwrap().0;
        print!(
            "seed {seed} minpeak {:.3}s ({:?}) [{}..{}] ",
            tmin.as_secs_f64(),
            lo.stats,
            lo.peak,
            hi
        );
        for f in [0.05, 0.3, 0.6, 0.9] {
            let b = lo.peak + ((hi - lo.peak) as f64 * f) as i64;
            let t = Instant::now();
            let s = solve_config(&p, b).unwrap();
            print!(
                " f{f}: {:.3}s free{} rows{} solves{} cuts{} k{}",
                t.elapsed().as_secs_f64(),
                s.stats.free_vars,
                s.stats.rows,
                s.stats.milp_solves,
                s.stats.nogood_cuts,
                s.x.iter().filter(|&&v| v).count()
            );
        }
        println!();
    }
}
