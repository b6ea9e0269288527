//! The selective states of a block (`BlockTerms::sel`, one per policy measured): on random
//! chains whose blocks have zero, one or two policies, every moment under every choice of keep,
//! full and selective under each policy per block equals the step walked directly with
//! branches (docs/memory-model.md's formulas, the policy's selective terms in place of the
//! checkpointed ones), and every solver engine finds the fastest choice under the budget that
//! brute force over all (up to 4^n) choices finds, in the solver's variable order. Some
//! selective states keep the block's output in their cache (`SelTerms::held`): a plain next
//! block then holds it from its forward's end to its backward's end.

use ckptune_solver::chain_model::{self, BlockTerms, SelTerms, StepTerms};
use ckptune_solver::problem::peak_of;
use ckptune_solver::solver::{solve_config_with, Engine, SolveOptions, SolveStatus, MAX_ENUMERATE};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Per block: 0 keep, 1 checkpointed, 2 + p selective under the block's policy `p`.
type Choice = Vec<u8>;

fn random_chain(rng: &mut StdRng, n: usize) -> StepTerms {
    let mut v = |lo: i64, hi: i64| rng.random_range(lo..hi);
    let blocks = (0..n)
        .map(|i| {
            let out = v(1, 40);
            // The output bytes a policy's cache keeps, the same for every policy that keeps it.
            let held = v(1, out + 1);
            let kg = out + v(0, 200);
            let g = v(0, 30);
            BlockTerms {
                name: format!("b{i}"),
                candidate: i != 0 || v(0, 2) == 0,
                kg,
                fg: kg + v(0, 60),
                kng: out,
                fng: v(0, 80),
                out,
                gout: out,
                krec: kg,
                frec: v(0, 150),
                bta: g + v(0, 100),
                btb: g + v(-20, 100),
                g,
                recompute_seconds: v(5, 50) as f64 / 100.0,
                sel: (0..[0, 1, 1, 2, 2, 2][v(0, 6) as usize])
                    .map(|_| {
                        let kept_sel = out + v(0, kg - out + 1);
                        SelTerms {
                            kf: kept_sel + v(0, 5),
                            kb: kept_sel,
                            fwd: v(0, 80),
                            frec: v(0, 100),
                            btb: g + v(-20, 100),
                            held: if v(0, 2) == 0 { 0 } else { held },
                            recompute_seconds: v(1, 20) as f64 / 100.0,
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    StepTerms {
        fixed: v(100, 1000),
        lk: v(0, 10),
        lf: v(0, 50),
        lb: v(0, 50),
        otmp: v(0, 300),
        base_seconds: 1.0,
        blocks,
        groups: Vec::new(),
    }
}

/// The peak and time of `c`, the step walked with branches.
fn walked(s: &StepTerms, c: &Choice) -> (i64, f64) {
    let b = &s.blocks;
    let n = b.len();
    let sel = |i: usize| &b[i].sel[c[i] as usize - 2];
    let kf = |i: usize| match c[i] {
        0 => b[i].kg,
        1 => b[i].kng,
        _ => sel(i).kf,
    };
    let kb = |i: usize| match c[i] {
        0 => b[i].krec,
        1 => b[i].out,
        _ => sel(i).kb,
    };
    // What block `i` holds of its input when it runs plain after a selective block whose cache
    // keeps its output.
    let held = |i: usize| match (i.checked_sub(1).map(|k| c[k]), c[i]) {
        (Some(k @ 2..), 0) => b[i - 1].sel[k as usize - 2].held,
        _ => 0,
    };
    let kf = |i: usize| kf(i) + held(i);
    let kb = |i: usize| kb(i) + held(i);
    let mut peaks = Vec::new();
    for j in 0..n {
        let own = match c[j] {
            0 => b[j].fg,
            1 => b[j].fng,
            _ => sel(j).fwd,
        };
        peaks.push(s.fixed + (0..j).map(kf).sum::<i64>() + own);
    }
    peaks.push(s.fixed + (0..n).map(kf).sum::<i64>() + s.lf);
    peaks.push(s.fixed + (0..n).map(kb).sum::<i64>() + s.lk + s.lb);
    for j in (0..n).rev() {
        let base = s.fixed + (j + 1..n).map(|i| b[i].g).sum::<i64>() + (0..j).map(kb).sum::<i64>() + b[j].gout;
        match c[j] {
            0 => peaks.push(base + b[j].krec + held(j) + b[j].bta),
            1 => peaks.extend([base + b[j].frec, base + b[j].krec + b[j].btb]),
            _ => peaks.extend([base + sel(j).frec, base + b[j].krec + sel(j).btb]),
        }
    }
    peaks.push(s.fixed + b.iter().map(|b| b.g).sum::<i64>() + s.otmp);
    let t = s.base_seconds
        + (0..n)
            .map(|i| match c[i] {
                0 => 0.0,
                1 => b[i].recompute_seconds,
                _ => sel(i).recompute_seconds,
            })
            .sum::<f64>();
    (peaks.into_iter().max().unwrap(), t)
}

/// Every choice the chain allows: candidates only, selective only where measured.
fn choices(s: &StepTerms) -> Vec<Choice> {
    let mut out: Vec<Choice> = vec![Vec::new()];
    for b in &s.blocks {
        let states: Vec<u8> = match b.candidate {
            false => vec![0],
            true => (0..2 + b.sel.len() as u8).collect(),
        };
        out = out
            .into_iter()
            .flat_map(|c| {
                states.iter().map(move |&k| {
                    let mut c = c.clone();
                    c.push(k);
                    c
                })
            })
            .collect();
    }
    out
}

/// The model's full choice for `c`.
fn full(s: &StepTerms, c: &Choice) -> Vec<bool> {
    let x: Vec<bool> = c.iter().map(|&k| k != 0).collect();
    let full = chain_model::with_selective(s, &x, &policies(c));
    assert_eq!(chain_model::split_selective(s, &full), (x, policies(c)), "{c:?}");
    full
}

/// Per block, the policy `c` runs it selective under.
fn policies(c: &Choice) -> Vec<Option<usize>> {
    c.iter().map(|&k| (k >= 2).then(|| k as usize - 2)).collect()
}

#[test]
fn moments_equal_the_walked_step_under_every_choice() {
    let mut rng = StdRng::seed_from_u64(0x5e1e);
    for case in 0..200 {
        let n = rng.random_range(1..6);
        let s = random_chain(&mut rng, n);
        let p = chain_model::config_problem("c", &s);
        for c in choices(&s) {
            let x = full(&s, &c);
            let (peak, _) = peak_of(&p.moments, &x).unwrap();
            let (want, t) = walked(&s, &c);
            assert_eq!(peak, want, "case {case} choice {c:?}");
            let got_t = s.base_seconds
                + p.seconds_coef
                    .iter()
                    .zip(&x)
                    .filter(|(_, &on)| on)
                    .map(|(t, _)| t)
                    .sum::<f64>();
            assert!(
                (got_t - t).abs() < 1e-9,
                "case {case} choice {c:?}: time {got_t} vs {t}"
            );
            // The choice respects the problem's exclusions.
            assert!(p.exclusive.iter().all(|g| g.iter().filter(|&&v| x[v]).count() <= 1));
        }
    }
}

#[test]
fn every_engine_finds_the_fastest_choice_brute_force_finds() {
    let mut rng = StdRng::seed_from_u64(0xc401ce);
    let (mut feasible, mut chose_selective, mut mixed, mut held) = (0, 0, 0, 0);
    for case in 0..150 {
        let n = rng.random_range(2..7);
        let s = random_chain(&mut rng, n);
        let all = choices(&s);
        let peaks: Vec<(i64, f64)> = all.iter().map(|c| walked(&s, c)).collect();
        let lo = peaks.iter().map(|p| p.0).min().unwrap();
        let hi = peaks.iter().map(|p| p.0).max().unwrap();
        let budget = rng.random_range(lo - 5..=hi);
        let best = peaks
            .iter()
            .zip(&all)
            .filter(|(p, _)| p.0 <= budget)
            .min_by(|a, b| a.0 .1.total_cmp(&b.0 .1));
        let order = chain_model::step_order(&s);
        let p = chain_model::permute(chain_model::config_problem("c", &s), &order);
        for engine in [Engine::Dp, Engine::Milp, Engine::Enumerate] {
            // Enumeration takes at most MAX_ENUMERATE variables (blocks, policies and `h`).
            if engine == Engine::Enumerate && p.candidate.len() > MAX_ENUMERATE {
                continue;
            }
            let sol = solve_config_with(
                &p,
                budget,
                SolveOptions {
                    engine,
                    ..Default::default()
                },
            )
            .unwrap();
            match best {
                None => assert_eq!(sol.status, SolveStatus::Infeasible, "case {case} {engine:?}"),
                Some(((_, t), c)) => {
                    assert_eq!(sol.status, SolveStatus::Optimal, "case {case} {engine:?}");
                    assert!(
                        (sol.seconds - t).abs() < 1e-9,
                        "case {case} {engine:?}: {} vs {t} ({c:?})",
                        sol.seconds
                    );
                    let x = chain_model::unpermute(&sol.x, &order);
                    let (peak, _) = peak_of(&chain_model::moments(&s), &x).unwrap();
                    assert!(peak <= budget, "case {case} {engine:?}");
                    if engine == Engine::Dp {
                        feasible += 1;
                        chose_selective += usize::from(x[s.blocks.len()..].contains(&true));
                        let (_, used) = chain_model::split_selective(&s, &x);
                        mixed += usize::from(used.contains(&Some(0)) && used.contains(&Some(1)));
                        let (mask, _) = chain_model::split_selective(&s, &x);
                        held += usize::from(
                            (1..mask.len())
                                .any(|j| !mask[j] && used[j - 1].is_some_and(|p| s.blocks[j - 1].sel[p].held > 0)),
                        );
                    }
                }
            }
        }
    }
    // The fastest choice mixes both policies in one plan in some cases (the trade per layer),
    // and in some runs a block plain after a selective one whose cache keeps its output.
    assert!(
        feasible > 50 && chose_selective > 10 && mixed > 3 && held > 3,
        "{feasible} feasible, {chose_selective} selective, {mixed} mixing policies, {held} holding"
    );
}
