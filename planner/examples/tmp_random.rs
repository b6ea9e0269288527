use ckptune::chain_model::*;
use ckptune::solver::*;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::Instant;
fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let n = args[0];
    let seeds = args[1] as u64;
    let bf16 = args.get(2).copied().unwrap_or(0) == 1;
    for seed in 0..seeds {
        let mut rng = StdRng::seed_from_u64(seed);
        let blocks: Vec<BlockTerms> = (0..n)
            .map(|i| {
                let out: i64 = rng.random_range(10_000_000..200_000_000);
                let g: i64 = rng.random_range(1_000_000..50_000_000);
                let kg = (out as f64 * rng.random_range(2.0..10.0)) as i64;
                let kng = if bf16 { out + rng.random_range(0..g) } else { out };
                let fg = kg + rng.random_range(0..out);
                BlockTerms {
                    name: format!("b{i}"),
                    candidate: true,
                    kg,
                    fg,
                    kng,
                    fng: out + rng.random_range(0..out),
                    out,
                    gout: out,
                    krec: kg,
                    frec: rng.random_range(0..out),
                    bta: g + rng.random_range(out..3 * out),
                    btb: g + rng.random_range(out..3 * out),
                    g,
                    recompute_seconds: rng.random_range(0.001..0.01),
                }
            })
            .collect();
        let step = StepTerms {
            fixed: 3 * blocks.iter().map(|b| b.g).sum::<i64>(),
            lk: 100,
            lf: 1000,
            lb: 1000,
            otmp: 1 << 20,
            base_seconds: 1.0,
            blocks,
        };
        let p = config_problem("r", &step);
        let t = Instant::now();
        let lo = min_peak(&p).unwrap();
        let tmin = t.elapsed();
        let hi = peak_of(&p.moments, &vec![false; n]).unwrap().0;
        print!(
            "seed {seed} minpeak {:.3}s dp{} gaveup{} ",
            tmin.as_secs_f64(),
            lo.stats.dp_runs,
            lo.stats.dp_gave_up
        );
        for f in [0.05, 0.3, 0.6, 0.9] {
            let b = lo.peak + ((hi - lo.peak) as f64 * f) as i64;
            let t = Instant::now();
            let s = solve_config(&p, b).unwrap();
            print!(
                " f{f}: {:.3}s gaveup{} milp{} k{}",
                t.elapsed().as_secs_f64(),
                s.stats.dp_gave_up,
                s.stats.milp_solves,
                s.x.iter().filter(|&&v| v).count()
            );
        }
        println!();
    }
}
