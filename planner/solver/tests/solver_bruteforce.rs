//! Every solver engine against brute force over all subsets and configurations, on
//! hundreds of random small instances, with exact `i64` checks of every returned choice.

use ckptune_solver::chain_model::{self, BlockTerms, FusedTerms, GroupTerms, StepTerms};
use ckptune_solver::problem::{peak_of, ConfigProblem, Moment, Occurs};
use ckptune_solver::solver::{
    min_peak_with, solve_with, ConfigSolution, Engine, SolveError, SolveOptions, SolveStatus,
};
use ckptune_solver::testing::synthetic_problem;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ENGINES: [Engine; 4] = [Engine::Auto, Engine::Dp, Engine::Milp, Engine::Enumerate];

/// Brute-force answer for one configuration.
#[derive(Debug)]
struct Reference {
    /// Fastest time among choices fitting the budget.
    best_time: Option<f64>,
    /// Smallest peak over all allowed choices, and the fastest time at that peak.
    min_peak: i64,
    min_peak_time: f64,
}

fn allowed(p: &ConfigProblem, x: &[bool]) -> bool {
    x.iter().zip(&p.candidate).all(|(&on, &c)| !on || c)
        && p.tied.iter().all(|class| class.iter().all(|&v| x[v] == x[class[0]]))
        && p.exclusive.iter().all(|g| {
            let mut g = g.clone();
            g.sort_unstable();
            g.dedup();
            g.iter().filter(|&&i| x[i]).count() <= 1
        })
}

fn seconds(p: &ConfigProblem, x: &[bool]) -> f64 {
    p.seconds_base
        + p.seconds_coef
            .iter()
            .zip(x)
            .filter(|(_, &on)| on)
            .map(|(t, _)| t)
            .sum::<f64>()
}

fn brute(p: &ConfigProblem, budget: i64) -> Reference {
    let n = p.candidate.len();
    let mut best_time: Option<f64> = None;
    let mut min_peak = i64::MAX;
    let mut min_peak_time = f64::INFINITY;
    for mask in 0u32..1 << n {
        let x: Vec<bool> = (0..n).map(|i| mask >> i & 1 == 1).collect();
        if !allowed(p, &x) {
            continue;
        }
        let peak = p.moments.iter().map(|m| m.eval(&x)).max().unwrap();
        let t = seconds(p, &x);
        if peak <= budget && best_time.is_none_or(|b| t < b) {
            best_time = Some(t);
        }
        if peak < min_peak || (peak == min_peak && t < min_peak_time) {
            min_peak = peak;
            min_peak_time = t;
        }
    }
    Reference {
        best_time,
        min_peak,
        min_peak_time,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
}

/// Random chain from the chain memory model (docs/memory-model.md). `scale` sets magnitudes: 1 gives small numbers
/// (many exact ties), 1e9 gives realistic byte counts up to ~1e12 in sums.
fn random_chain(rng: &mut StdRng, n: usize, scale: f64) -> StepTerms {
    let mut v = |lo: f64, hi: f64| (rng.random_range(lo..hi) * scale).round() as i64;
    let blocks: Vec<BlockTerms> = (0..n)
        .map(|i| {
            let out = v(1.0, 40.0);
            let kg = out + v(0.0, 200.0);
            let g = v(0.0, 30.0);
            BlockTerms {
                name: format!("b{i}"),
                candidate: true,
                kg,
                fg: kg + v(0.0, 60.0),
                kng: out + v(0.0, 20.0).min(kg - out),
                fng: v(0.0, 80.0),
                out,
                gout: out,
                krec: kg + v(-5.0, 5.0).max(out - kg),
                frec: v(0.0, 150.0),
                bta: g + v(0.0, 100.0),
                btb: g + v(0.0, 100.0),
                g,
                recompute_seconds: 0.0,
                sel: Vec::new(),
            }
        })
        .collect();
    StepTerms {
        fixed: v(100.0, 1000.0),
        lk: v(0.0, 10.0),
        lf: v(0.0, 30.0),
        lb: v(0.0, 30.0),
        otmp: v(0.0, 400.0),
        base_seconds: 0.0,
        blocks,
        groups: Vec::new(),
    }
}

/// Adds `count` (1 or 2) disjoint groups (nested candidates) over runs of two to four
/// blocks, with random terms of the same magnitudes as the blocks'. Needs `2 · count` blocks.
fn add_groups(rng: &mut StdRng, step: &mut StepTerms, count: usize, scale: f64) {
    let n = step.blocks.len();
    assert!(n >= 2 * count);
    // Group g lives in its own slice of the chain, so the groups are disjoint and ordered.
    let slice = n / count;
    for g in 0..count {
        let (lo, hi) = (g * slice, if g + 1 == count { n } else { (g + 1) * slice });
        let first = rng.random_range(lo..hi - 1);
        let last = rng.random_range(first + 1..hi.min(first + 4));
        let len = last - first + 1;
        let mut v = |lo: f64, hi: f64| (rng.random_range(lo..hi) * scale).round() as i64;
        let out = step.blocks[last].out;
        step.groups.push(GroupTerms {
            name: format!("g{g}"),
            first,
            last,
            kept: out + v(0.0, 10.0),
            cache: v(0.0, 20.0),
            fwd: (0..len).map(|_| v(0.0, 300.0)).collect(),
            carry: v(0.0, 60.0),
            rec: (0..len).map(|_| v(0.0, 400.0)).collect(),
            bwd: (0..len).map(|_| v(0.0, 500.0)).collect(),
            recompute_seconds: 0.0,
            fused: None,
        });
        // Most groups also run fused (as every measured group does).
        if rng.random_bool(0.8) {
            let mut v = |lo: f64, hi: f64| (rng.random_range(lo..hi) * scale).round() as i64;
            let fused = FusedTerms {
                kept: out + v(0.0, 40.0),
                cache: v(0.0, 20.0),
                fwd: (0..len).map(|_| v(0.0, 300.0)).collect(),
                carry: v(0.0, 60.0),
                bwd: v(0.0, 500.0),
            };
            step.groups.last_mut().expect("just pushed").fused = Some(fused);
        }
    }
}

/// The peak of `step` under `x` (blocks, then groups) by walking the step as the runtime
/// executes it: the reference for the affine encoding of groups.
fn walked_peak(step: &StepTerms, x: &[bool]) -> i64 {
    let (b, n) = (&step.blocks, step.blocks.len());
    // Ok(block), Err((group, fused)).
    type Unit<'a> = Result<usize, (&'a GroupTerms, bool)>;
    let mut units: Vec<Unit<'_>> = Vec::new();
    let mut j = 0;
    while j < n {
        let found = step.groups.iter().enumerate().find(|(_, grp)| grp.first == j);
        match found {
            Some((g, grp)) if x[n + g] => {
                units.push(Err((grp, false)));
                j = grp.last + 1;
            }
            Some((_, grp)) if grp.fused.is_some() && !x[grp.first..=grp.last].contains(&true) => {
                units.push(Err((grp, true)));
                j = grp.last + 1;
            }
            _ => {
                units.push(Ok(j));
                j += 1;
            }
        }
    }
    let group_kept = |g: &GroupTerms, fused: bool| if fused { g.fused.as_ref().unwrap().kept } else { g.kept };
    let group_cache = |g: &GroupTerms, fused: bool| {
        if fused {
            g.fused.as_ref().unwrap().cache
        } else {
            g.cache
        }
    };
    // While the forward's autocast region is open (the forward and the loss).
    let kf = |u: &Unit<'_>| match *u {
        Ok(i) if x[i] => b[i].kng,
        Ok(i) => b[i].kg,
        Err((g, fused)) => group_kept(g, fused) + group_cache(g, fused),
    };
    let kb = |u: &Unit<'_>| match *u {
        Ok(i) if x[i] => b[i].out,
        Ok(i) => b[i].krec,
        Err((g, fused)) => group_kept(g, fused),
    };
    let mut peak = i64::MIN;
    let mut level = step.fixed;
    for u in &units {
        match *u {
            Ok(j) => peak = peak.max(level + if x[j] { b[j].fng } else { b[j].fg }),
            Err((g, false)) => peak = peak.max(level + g.fwd.iter().max().unwrap()),
            Err((g, true)) => peak = peak.max(level + g.fused.as_ref().unwrap().fwd.iter().max().unwrap()),
        }
        level += kf(u);
    }
    let all: i64 = step.fixed + units.iter().map(kb).sum::<i64>();
    peak = peak.max(level + step.lf).max(all + step.lk + step.lb);
    let mut below = all;
    let mut grads = 0;
    for u in units.iter().rev() {
        below -= kb(u);
        match *u {
            Ok(j) => {
                let base = below + grads + b[j].gout;
                if x[j] {
                    peak = peak.max(base + b[j].frec);
                }
                peak = peak.max(base + b[j].krec + if x[j] { b[j].btb } else { b[j].bta });
                grads += b[j].g;
            }
            Err((g, fused)) => {
                peak = peak.max(if fused {
                    let f = g.fused.as_ref().unwrap();
                    below + grads + f.carry + f.kept + f.bwd
                } else {
                    below + grads + g.carry + g.rec.iter().chain(&g.bwd).max().unwrap()
                });
                grads += b[g.first..=g.last].iter().map(|k| k.g).sum::<i64>();
            }
        }
    }
    peak.max(step.fixed + grads + step.otmp)
}

/// The affine moments of a chain with groups give, for every allowed choice, the peak of
/// the step walked as the runtime runs it; and permuting into the solver's order and back
/// changes nothing.
#[test]
fn nested_moments_equal_the_walked_step() {
    let mut rng = StdRng::seed_from_u64(0x6e57);
    let mut checked = 0;
    for case in 0..300 {
        let n = rng.random_range(2..=7);
        let scale = if rng.random_bool(0.5) { 1.0 } else { 1e9 };
        let mut step = random_chain(&mut rng, n, scale);
        let count = rng.random_range(1..=n / 2).min(2);
        add_groups(&mut rng, &mut step, count, scale);
        let p = chain_model::config_problem("nested", &step);
        let groups: Vec<(usize, usize)> = step.groups.iter().map(|g| (g.first, g.last)).collect();
        let order = chain_model::solver_order(n, &groups);
        let q = chain_model::permute(p.clone(), &order);
        // Runtime masks cover blocks and groups; the fused variables follow from them.
        let units = n + step.groups.len();
        for mask in 0u32..1 << units {
            let r: Vec<bool> = (0..units).map(|i| mask >> i & 1 == 1).collect();
            let mut x = chain_model::with_fused(&r, n, &groups);
            for (g, grp) in step.groups.iter().enumerate() {
                x[units + g] &= grp.fused.is_some();
            }
            if !allowed(&p, &x) || !(0..n).all(|i| !x[i] || p.candidate[i]) {
                continue;
            }
            let want = walked_peak(&step, &r);
            assert_eq!(peak_of(&p.moments, &x).unwrap().0, want, "case {case} {x:?}");
            let y: Vec<bool> = order.iter().map(|&u| x[u]).collect();
            assert_eq!(chain_model::unpermute(&y, &order), x);
            assert_eq!(peak_of(&q.moments, &y).unwrap().0, want, "case {case} permuted {x:?}");
            checked += 1;
        }
    }
    assert!(checked > 3000, "{checked} choices checked");
}

/// Arbitrary affine moments with mixed signs: no chain structure at all.
fn random_moments(rng: &mut StdRng, n: usize, scale: f64) -> Vec<Moment> {
    (0..rng.random_range(n..4 * n + 4))
        .map(|k| Moment {
            label: format!("m{k}"),
            constant: (rng.random_range(200.0..1000.0) * scale) as i64,
            coef: (0..n)
                .map(|_| {
                    if rng.random_bool(0.3) {
                        0
                    } else {
                        (rng.random_range(-150.0..60.0) * scale) as i64
                    }
                })
                .collect(),
            occurs: Occurs::Always,
        })
        .collect()
}

fn random_problem(rng: &mut StdRng, n: usize, c: usize) -> ConfigProblem {
    let scale = if rng.random_bool(0.5) { 1.0 } else { 1e9 };
    // Nested candidates: n − 2k blocks and k groups (a checkpointed and a fused variable
    // each), in the solver's order.
    if n >= 4 && rng.random_bool(0.25) {
        let k = if n >= 8 { 2 } else { 1 };
        let mut step = random_chain(rng, n - 2 * k, scale);
        add_groups(rng, &mut step, k, scale);
        let quantized = rng.random_bool(0.3);
        let mut t = || {
            if quantized {
                f64::from(rng.random_range(0..4u8)) * 0.25
            } else {
                rng.random_range(0.0..1.0)
            }
        };
        for b in &mut step.blocks {
            b.recompute_seconds = t();
        }
        for g in &mut step.groups {
            g.recompute_seconds = t();
        }
        let groups: Vec<(usize, usize)> = step.groups.iter().map(|g| (g.first, g.last)).collect();
        let p = chain_model::config_problem(format!("config{c}"), &step);
        let mut p = chain_model::permute(p, &chain_model::solver_order(n - 2 * k, &groups));
        p.seconds_base = rng.random_range(1.0..2.0);
        return p;
    }
    let moments = if rng.random_bool(0.75) {
        chain_model::moments(&random_chain(rng, n, scale))
    } else {
        random_moments(rng, n, scale)
    };
    // Quantized times on some instances so that exact ties occur.
    let quantized = rng.random_bool(0.3);
    let seconds_coef = (0..n)
        .map(|_| {
            if quantized {
                f64::from(rng.random_range(0..4u8)) * 0.25
            } else {
                rng.random_range(0.0..1.0)
            }
        })
        .collect();
    let candidate = (0..n).map(|_| rng.random_bool(0.85)).collect();
    let mut exclusive = Vec::new();
    if n >= 2 && rng.random_bool(0.4) {
        for _ in 0..rng.random_range(1..3) {
            let a = rng.random_range(0..n - 1);
            let b = rng.random_range(a + 1..n.min(a + 4));
            exclusive.push((a..=b).collect());
        }
    }
    // A module called several times: its calls, anywhere in the chain, decided together.
    let mut tied = Vec::new();
    if n >= 3 && rng.random_bool(0.4) {
        for _ in 0..rng.random_range(1..3) {
            let mut class: Vec<usize> = (0..n).filter(|_| rng.random_bool(0.4)).collect();
            if class.len() < 2 {
                class = vec![rng.random_range(0..n / 2), rng.random_range(n / 2..n)];
            }
            tied.push(class);
        }
    }
    ConfigProblem {
        key: format!("config{c}"),
        moments,
        seconds_base: rng.random_range(1.0..2.0),
        seconds_coef,
        candidate,
        exclusive,
        tied,
    }
}

/// The checks every returned choice must pass, whatever the engine.
fn check_solution(p: &ConfigProblem, s: &ConfigSolution, what: &str) {
    assert_eq!(s.key, p.key, "{what}");
    assert!(allowed(p, &s.x), "{what}: choice {:?} breaks candidates or groups", s.x);
    let (peak, k) = peak_of(&p.moments, &s.x).unwrap();
    assert_eq!(s.peak, peak, "{what}: reported peak");
    assert_eq!(s.binding, p.moments[k].label, "{what}: binding moment");
    assert!(close(s.seconds, seconds(p, &s.x)), "{what}: reported time");
}

#[test]
fn engines_match_brute_force_on_random_instances() {
    let all: Vec<SolveOptions> = ENGINES
        .iter()
        .map(|&engine| SolveOptions {
            engine,
            ..Default::default()
        })
        .collect();
    let c = run_cases(0x5eed_cafe, 400, &all);
    eprintln!("{c:?}");
    // The mix must exercise every outcome and the MILP path itself.
    assert!(c.feasible >= 800 && c.infeasible >= 100, "{c:?}");
    assert!(c.milp_solves >= 1000, "{c:?}");
    assert!(
        c.dp_gave_up >= 10,
        "the Auto engine rarely fell back to the MILP: {c:?}"
    );
}

/// The HiGHS backend, where it is built, under the same checks.
#[cfg(feature = "highs")]
#[test]
fn highs_backend_matches_brute_force() {
    let highs = SolveOptions {
        engine: Engine::Milp,
        backend: ckptune_solver::solver::Backend::Highs,
    };
    let c = run_cases(0x4816, 200, &[highs]);
    assert!(c.milp_solves >= 300, "{c:?}");
}

#[derive(Debug, Default)]
struct Counts {
    feasible: u32,
    infeasible: u32,
    milp_solves: u32,
    cover_cuts: u32,
    dp_gave_up: u32,
}

/// Random instances checked under every option set in `engines`.
fn run_cases(seed: u64, cases: usize, engines: &[SolveOptions]) -> Counts {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut counts = Counts::default();
    let Counts {
        feasible,
        infeasible,
        milp_solves,
        cover_cuts,
        dp_gave_up,
    } = &mut counts;
    for case in 0..cases {
        let n = rng.random_range(1..=10);
        let problems: Vec<ConfigProblem> = (0..rng.random_range(1..=4))
            .map(|c| random_problem(&mut rng, n, c))
            .collect();
        let refs0: Vec<Reference> = problems.iter().map(|p| brute(p, 0)).collect();
        let lo = refs0.iter().map(|r| r.min_peak).min().unwrap();
        let hi = problems
            .iter()
            .map(|p| peak_of(&p.moments, &vec![false; n]).unwrap().0)
            .max()
            .unwrap();
        // Mostly between the smallest achievable and the unconstrained peak; some below.
        let budget = if rng.random_bool(0.15) {
            (lo - rng.random_range(1..=10)).max(0)
        } else {
            rng.random_range(lo..=hi.max(lo))
        };
        let refs: Vec<Reference> = problems.iter().map(|p| brute(p, budget)).collect();
        let best = refs.iter().filter_map(|r| r.best_time).min_by(f64::total_cmp);

        for &opts in engines {
            let engine = opts.engine;
            let what = format!("case {case} {opts:?} budget {budget}");
            // Per-configuration minimal peaks, exactly.
            for (p, r) in problems.iter().zip(&refs) {
                match min_peak_with(p, opts) {
                    Ok(m) => {
                        check_solution(p, &m, &what);
                        assert_eq!(m.peak, r.min_peak, "{what}: min peak of {}", p.key);
                        assert!(
                            close(m.seconds, r.min_peak_time),
                            "{what}: time at min peak of {}",
                            p.key
                        );
                        *milp_solves += m.stats.milp_solves;
                        *cover_cuts += m.stats.cover_cuts;
                        *dp_gave_up += m.stats.dp_gave_up;
                        assert_eq!(m.stats.enumerated, None, "{what}: the MILP fell back to enumeration");
                    }
                    Err(SolveError::NoChainStructure { .. }) if engine == Engine::Dp => {}
                    Err(e) => panic!("{what}: {e}"),
                }
            }
            let plan = match solve_with(&problems, budget, opts) {
                Err(SolveError::NoChainStructure { .. }) if engine == Engine::Dp => continue,
                other => other,
            };
            match (best, plan) {
                (Some(best), Ok(plan)) => {
                    let chosen = plan.chosen();
                    assert!(
                        close(chosen.seconds, best),
                        "{what}: {} vs brute {best}",
                        chosen.seconds
                    );
                    assert!(chosen.peak <= budget, "{what}: chosen peak over budget");
                    for ((p, r), s) in problems.iter().zip(&refs).zip(&plan.configs) {
                        check_solution(p, s, &what);
                        assert!(
                            p.moments
                                .iter()
                                .all(|m| s.status != SolveStatus::Optimal || m.eval(&s.x) <= budget),
                            "{what}: a moment exceeds the budget"
                        );
                        match (r.best_time, s.status) {
                            (Some(t), SolveStatus::Optimal) => assert!(close(s.seconds, t), "{what}: {}", p.key),
                            (None, SolveStatus::Infeasible) => {
                                assert_eq!(s.peak, r.min_peak, "{what}: {}", p.key);
                                assert!(close(s.seconds, r.min_peak_time), "{what}: {}", p.key);
                            }
                            (want, got) => panic!("{what}: {} brute {want:?}, solver {got:?}", p.key),
                        }
                        *milp_solves += s.stats.milp_solves;
                        *cover_cuts += s.stats.cover_cuts;
                        *dp_gave_up += s.stats.dp_gave_up;
                        assert_eq!(s.stats.enumerated, None, "{what}: the MILP fell back to enumeration");
                    }
                    *feasible += 1;
                }
                (
                    None,
                    Err(SolveError::Infeasible {
                        budget: b,
                        min_peak,
                        key,
                        binding,
                        x,
                    }),
                ) => {
                    assert_eq!((b, min_peak), (budget, lo), "{what}");
                    let p = problems.iter().find(|p| p.key == key).expect("key names a config");
                    let r = &refs[problems.iter().position(|q| q.key == key).unwrap()];
                    assert_eq!(r.min_peak, lo, "{what}: {key} does not attain the smallest peak");
                    assert!(allowed(p, &x), "{what}");
                    let (peak, k) = peak_of(&p.moments, &x).unwrap();
                    assert_eq!((peak, binding.as_str()), (lo, p.moments[k].label.as_str()), "{what}");
                    *infeasible += 1;
                }
                (want, got) => panic!("{what}: brute {want:?}, solver {got:?}"),
            }
        }
    }
    counts
}

/// docs/memory-model.md: a block's own backward moment depends only on the blocks before it,
/// so checkpointing the first block sets a floor that nothing else lowers.
#[test]
fn checkpointing_the_first_block_sets_a_floor() {
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..50 {
        let n = rng.random_range(2..=8);
        let step = random_chain(&mut rng, n, 1e6);
        let ms = chain_model::moments(&step);
        let first = &step.blocks[0];
        let bwd = ms
            .iter()
            .find(|m| m.label == format!("backward {}", first.name))
            .unwrap();
        // Its coefficients: only x_0's own transient switch (btb − bta).
        assert_eq!(bwd.coef[0], first.btb - first.bta);
        assert!(bwd.coef[1..].iter().all(|&c| c == 0));
        let floor =
            step.fixed + step.blocks[1..].iter().map(|b| b.g).sum::<i64>() + first.gout + first.krec + first.btb;
        for mask in 0u32..1 << (n - 1) {
            let mut x = vec![true];
            x.extend((0..n - 1).map(|i| mask >> i & 1 == 1));
            assert!(chain_model::peak(&step, &x).0 >= floor);
            assert_eq!(bwd.eval(&x), floor);
        }
    }
}

/// The synthetic generator the benchmark uses solves by every engine to the same time.
#[test]
fn synthetic_chains_agree_across_engines() {
    for seed in 0..4 {
        let p = synthetic_problem(14, seed);
        let lo = min_peak_with(&p, SolveOptions::default()).unwrap();
        let hi = peak_of(&p.moments, &[false; 14]).unwrap().0;
        for f in [0.0, 0.2, 0.5, 0.9] {
            let budget = lo.peak + ((hi - lo.peak) as f64 * f) as i64;
            let times: Vec<f64> = ENGINES
                .iter()
                .map(|&engine| {
                    let plan = solve_with(
                        std::slice::from_ref(&p),
                        budget,
                        SolveOptions {
                            engine,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                    check_solution(&p, plan.chosen(), "synthetic");
                    assert!(plan.chosen().peak <= budget);
                    plan.chosen().seconds
                })
                .collect();
            assert!(
                times.iter().all(|&t| close(t, times[0])),
                "seed {seed} f {f}: {times:?}"
            );
        }
    }
}

/// A BERT-like chain at nested granularity: `layers` identical layers of three blocks, each
/// layer also a group, between two plain blocks. Identical layers make many choices tie,
/// the hardest case for the DP's dominance pruning.
fn nested_layers(rng: &mut StdRng, layers: usize) -> (StepTerms, Vec<usize>) {
    let ends = random_chain(rng, 2, 1e6);
    let layer = random_chain(rng, 3, 1e6);
    let mut step = StepTerms {
        blocks: vec![ends.blocks[0].clone()],
        ..ends.clone()
    };
    let mut proto = layer.clone();
    add_groups(rng, &mut proto, 1, 1e6);
    let mut g = proto.groups[0].clone();
    // The group covers the whole layer.
    g.first = 0;
    g.last = 2;
    g.fwd.resize(3, g.fwd[0]);
    g.rec.resize(3, g.rec[0]);
    g.bwd.resize(3, g.bwd[0]);
    for l in 0..layers {
        let first = step.blocks.len();
        for (k, b) in layer.blocks.iter().enumerate() {
            let mut b = b.clone();
            b.name = format!("layer.{l}.{k}");
            b.recompute_seconds = 0.1 * (k + 1) as f64;
            step.blocks.push(b);
        }
        step.groups.push(GroupTerms {
            name: format!("layer.{l}"),
            first,
            last: first + 2,
            recompute_seconds: 0.55,
            fused: Some(FusedTerms {
                kept: layer.blocks.iter().map(|b| b.kg).sum::<i64>() - 1_000_000,
                cache: 0,
                fwd: vec![g.fwd[0]; 3],
                carry: g.carry,
                bwd: g.bwd[0],
            }),
            ..g.clone()
        });
    }
    step.blocks.push(ends.blocks[1].clone());
    let groups: Vec<(usize, usize)> = step.groups.iter().map(|g| (g.first, g.last)).collect();
    let order = chain_model::solver_order(step.blocks.len(), &groups);
    (step, order)
}

/// The DP keeps nested chains in its small state (no fallback to the MILP), agrees with brute
/// force where that is possible, and at 24 layers never loses to checkpointing every layer
/// whole when that fits.
#[test]
fn dp_solves_nested_chains() {
    let mut rng = StdRng::seed_from_u64(0xbe27);
    for layers in [2, 3, 24] {
        for _ in 0..4 {
            let (step, order) = nested_layers(&mut rng, layers);
            let p = chain_model::permute(chain_model::config_problem("nested", &step), &order);
            let units = p.candidate.len();
            let lo = min_peak_with(
                &p,
                SolveOptions {
                    engine: Engine::Dp,
                    ..Default::default()
                },
            )
            .unwrap();
            // Nothing checkpointed: every group fused.
            let n = step.blocks.len();
            let m = step.groups.len();
            let mut fused_all = vec![false; units];
            for (v, &u) in order.iter().enumerate() {
                fused_all[v] = u >= n + m;
            }
            let hi = peak_of(&p.moments, &fused_all).unwrap().0;
            for f in [0.0, 0.3, 0.7] {
                let budget = lo.peak + ((hi - lo.peak) as f64 * f) as i64;
                let dp = SolveOptions {
                    engine: Engine::Dp,
                    ..Default::default()
                };
                let plan = solve_with(std::slice::from_ref(&p), budget, dp).unwrap();
                let s = plan.chosen();
                check_solution(&p, s, "nested dp");
                assert!(s.peak <= budget);
                if units <= 14 {
                    let r = brute(&p, budget);
                    assert!(close(s.seconds, r.best_time.unwrap()), "{layers} layers f {f}");
                } else {
                    let mut whole = vec![false; units];
                    for (v, &u) in order.iter().enumerate() {
                        whole[v] = (n..n + m).contains(&u);
                    }
                    let (peak, _) = peak_of(&p.moments, &whole).unwrap();
                    if peak <= budget {
                        assert!(s.seconds <= seconds(&p, &whole) + 1e-9, "{layers} layers f {f}");
                    }
                }
            }
        }
    }
}

/// A stage of 36 blocks nested in one group (ResNet-152's `layer3`): the DP keeps the
/// group's 73 exclusive pairs in two bits, so it solves it itself, and exactly as the
/// exhaustive engines do on a shorter stage.
#[test]
fn dp_solves_a_stage_of_36_nested_blocks() {
    let mut rng = StdRng::seed_from_u64(0x36);
    for blocks in [6, 38] {
        let mut step = random_chain(&mut rng, blocks, 1e6);
        add_groups(&mut rng, &mut step, 1, 1e6);
        let g = &mut step.groups[0];
        g.first = 1;
        g.last = blocks - 2;
        let len = g.last - g.first + 1;
        g.fwd.resize(len, g.fwd[0]);
        g.rec.resize(len, g.rec[0]);
        g.bwd.resize(len, g.bwd[0]);
        let f = g.fused.get_or_insert(FusedTerms {
            kept: 0,
            cache: 0,
            fwd: vec![],
            carry: 0,
            bwd: 0,
        });
        f.fwd.resize(len, 1_000_000);
        f.kept = step.blocks[1..blocks - 1].iter().map(|b| b.kg).sum::<i64>() / 2;
        for (i, b) in step.blocks.iter_mut().enumerate() {
            b.recompute_seconds = 0.01 * (1 + i % 5) as f64;
        }
        step.groups[0].recompute_seconds = 0.5;
        let groups: Vec<(usize, usize)> = step.groups.iter().map(|g| (g.first, g.last)).collect();
        let order = chain_model::solver_order(blocks, &groups);
        let p = chain_model::permute(chain_model::config_problem("stage", &step), &order);
        let dp = SolveOptions {
            engine: Engine::Dp,
            ..Default::default()
        };
        let lo = min_peak_with(&p, dp).unwrap();
        let mut fused = vec![false; p.candidate.len()];
        fused[order.iter().position(|&u| u == blocks + 1).unwrap()] = true;
        let hi = peak_of(&p.moments, &fused).unwrap().0;
        for f in [0.0, 0.25, 0.5, 0.75] {
            let budget = lo.peak + ((hi - lo.peak) as f64 * f) as i64;
            let s = solve_with(std::slice::from_ref(&p), budget, dp).unwrap();
            check_solution(&p, s.chosen(), "stage");
            assert!(s.chosen().peak <= budget);
            if blocks <= 8 {
                let e = SolveOptions {
                    engine: Engine::Enumerate,
                    ..Default::default()
                };
                let r = solve_with(std::slice::from_ref(&p), budget, e).unwrap();
                assert!(close(s.chosen().seconds, r.chosen().seconds), "{blocks} blocks f {f}");
            }
        }
    }
}
