//! Solver benchmark: solve time for 24, 100 and 300 candidate blocks × 12 configs, with the
//! default engine (exact chain dynamic program, MILP fallback) and with the MILP alone
//! (microlp; HiGHS too when built with `--features highs`), on the synthetic ResNet/BERT-like
//! chains of `ckptune_solver::testing::synthetic_problem`. Budgets sweep from tight to loose.
//!
//!     cargo run --release -p ckptune-solver --features highs --example bench_solver -- results/solver
//!
//! writes `results/solver.json` and `results/solver.md` (atomically).

use std::time::Instant;

use ckptune_solver::formats::{write_atomic, SolverBenchRow as Row};
use ckptune_solver::problem::ConfigProblem;
use ckptune_solver::solver::{self, Backend, Engine, SolveOptions};

fn budget_for(problems: &[ConfigProblem], f: f64) -> i64 {
    // Between the smallest achievable peak and the largest peak with nothing checkpointed.
    let lo = problems
        .iter()
        .map(|p| solver::min_peak(p).map(|s| s.peak).unwrap_or(i64::MAX))
        .min()
        .unwrap_or(0);
    let hi = problems
        .iter()
        .map(|p| {
            ckptune_solver::problem::peak_of(&p.moments, &vec![false; p.candidate.len()])
                .map(|x| x.0)
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    lo + ((hi - lo) as f64 * f) as i64
}

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "results/solver".to_owned());
    #[allow(unused_mut)] // pushed to with the `highs` feature
    let mut engines: Vec<(String, SolveOptions)> = vec![
        ("default (chain DP, exact)".into(), SolveOptions::default()),
        (
            "MILP microlp".into(),
            SolveOptions {
                engine: Engine::Milp,
                backend: Backend::Microlp,
            },
        ),
    ];
    #[cfg(feature = "highs")]
    engines.push((
        "MILP HiGHS".into(),
        SolveOptions {
            engine: Engine::Milp,
            backend: Backend::Highs,
        },
    ));
    let mut rows = Vec::new();
    for blocks in [12usize, 24, 100, 300] {
        let problems: Vec<ConfigProblem> = (0..12)
            .map(|s| ckptune_solver::testing::synthetic_problem(blocks, s))
            .collect();

        for (name, opts) in &engines {
            // microlp alone takes minutes to prove optimality on chains of identical blocks (it
            // has no cutting planes; ARCHITECTURE.md): it is measured on 12 blocks, to show why
            // the chain DP is the default. HiGHS (feature `highs`) is measured up to 100 blocks;
            // at 300 it needed minutes per budget (over 200 s for 12 configs at the tight one).
            let microlp = opts.engine == Engine::Milp && opts.backend == Backend::Microlp;
            let default = opts.engine == Engine::Auto;
            let highs_too_large = opts.engine == Engine::Milp && blocks > 100;
            if (microlp && blocks != 12) || (default && blocks == 12) || highs_too_large {
                continue;
            }
            for f in [0.1, 0.5, 0.9] {
                let budget = budget_for(&problems, f);
                let t0 = Instant::now();
                let r = solver::solve_with(&problems, budget, *opts);
                let seconds = t0.elapsed().as_secs_f64();
                let feasible = match &r {
                    Ok(p) => p
                        .configs
                        .iter()
                        .filter(|c| c.status == solver::SolveStatus::Optimal)
                        .count(),
                    Err(_) => 0,
                };
                eprintln!("{blocks:>4} blocks × 12 configs, {name}, budget at {f:.1}: {seconds:.4} s");
                rows.push(Row {
                    blocks,
                    configs: 12,
                    engine: name.clone(),
                    budget_fraction: f,
                    seconds,
                    feasible_configs: feasible,
                    optimal: r.is_ok() || matches!(r, Err(solver::SolveError::Infeasible { .. })),
                });
            }
        }
    }
    let json_path = std::path::PathBuf::from(format!("{out}.json"));
    write_atomic(&json_path, &rows).expect("writing the benchmark JSON");
    let mut md = String::from(
        "# Solver benchmark\n\nWritten by `cargo run --release -p ckptune-solver --features highs --example bench_solver -- results/solver`.\n\
         12 synthetic configs (ResNet- and BERT-like chains, fp32 and bf16 terms) per size; the budget sits at the\n\
         given fraction between the smallest achievable peak and the largest plain peak.\n\n\
         | blocks | configs | engine | budget | seconds | configs that fit | proven optimal |\n|---|---|---|---|---|---|---|\n",
    );
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.4} | {} | {} |\n",
            r.blocks,
            r.configs,
            r.engine,
            r.budget_fraction,
            r.seconds,
            r.feasible_configs,
            if r.optimal { "yes" } else { "no" }
        ));
    }
    let tmp = format!("{out}.md.tmp");
    std::fs::write(&tmp, md).expect("writing the benchmark table");
    std::fs::rename(&tmp, format!("{out}.md")).expect("renaming the benchmark table");
}
