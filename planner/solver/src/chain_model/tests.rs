//! The chain model against formulas worked by hand and evaluated directly.

use super::*;

fn block(name: &str, seed: i64) -> BlockTerms {
    BlockTerms {
        name: name.to_string(),
        candidate: true,
        kg: 100 * seed,
        fg: 120 * seed,
        kng: 10 * seed,
        fng: 30 * seed,
        out: 10 * seed,
        gout: 10 * seed,
        krec: 95 * seed,
        frec: 20 * seed,
        bta: 40 * seed,
        btb: 45 * seed,
        g: 7 * seed,
        recompute_seconds: 0.1 * seed as f64,
        sel: Vec::new(),
    }
}

fn step() -> StepTerms {
    StepTerms {
        fixed: 1000,
        lk: 5,
        lf: 9,
        lb: 3,
        otmp: 50,
        base_seconds: 1.0,
        blocks: vec![block("a", 1), block("b", 2), block("c", 3)],
        groups: Vec::new(),
    }
}

/// The formulas of docs/memory-model.md worked by hand for blocks a, b, c (terms of c are 3× those of a).
/// kf deltas (kng − kg): −90, −180, −270; kb deltas (out − krec): −85, −170, −255.
#[test]
fn hand_computed_three_blocks() {
    let ms = moments(&step());
    let got: Vec<(&str, i64, Vec<i64>)> = ms
        .iter()
        .map(|m| (m.label.as_str(), m.constant, m.coef.clone()))
        .collect();
    let want: Vec<(&str, i64, Vec<i64>)> = vec![
        // F + fg_a = 1000 + 120; own term fng_a − fg_a = −90.
        ("forward a", 1120, vec![-90, 0, 0]),
        // F + kg_a + fg_b = 1000 + 100 + 240; own term 60 − 240.
        ("forward b", 1340, vec![-90, -180, 0]),
        // F + kg_a + kg_b + fg_c = 1000 + 100 + 200 + 360; own term 90 − 360.
        ("forward c", 1660, vec![-90, -180, -270]),
        // Inside the forward's autocast region: F + Σ kg + lf = 1000 + 100 + 200 + 300 + 9.
        ("loss", 1609, vec![-90, -180, -270]),
        // F + Σ krec + lk + lb = 1570 + 5 + 3.
        ("loss backward", 1578, vec![-85, -170, -255]),
        // base_c = F + 0 + krec_a + krec_b + gout_c = 1000 + 95 + 190 + 30 = 1315;
        // phantom −1 when x_c = 0, frec_c = 60 when x_c = 1: coefficient 61.
        ("recompute c", 1314, vec![-85, -170, 61]),
        // base_c + krec_c + bta_c = 1315 + 285 + 120; btb − bta = 15.
        ("backward c", 1720, vec![-85, -170, 15]),
        // base_b = F + g_c + krec_a + gout_b = 1000 + 21 + 95 + 20 = 1136.
        ("recompute b", 1135, vec![-85, 41, 0]),
        ("backward b", 1406, vec![-85, 10, 0]),
        // base_a = F + g_b + g_c + gout_a = 1000 + 14 + 21 + 10 = 1045.
        ("recompute a", 1044, vec![21, 0, 0]),
        ("backward a", 1180, vec![5, 0, 0]),
        // F + Σ g + otmp = 1000 + 42 + 50.
        ("optimizer", 1092, vec![0, 0, 0]),
    ];
    assert_eq!(got, want);
    let s = step();
    assert_eq!(peak(&s, &[false, false, false]), (1720, "backward c".to_string()));
    // All checkpointed: forward c 1120, loss 1069, recompute c 1120, backward c 1480.
    assert_eq!(peak(&s, &[true, true, true]), (1480, "backward c".to_string()));
    // a and c: forward c 1300, backward c 1720 − 85 + 15 = 1650.
    assert_eq!(peak(&s, &[true, false, true]), (1650, "backward c".to_string()));
}

/// Every moment, for every x, equals the formula evaluated directly with branches.
#[test]
fn affine_moments_match_direct_formulas() {
    let s = step();
    let ms = moments(&s);
    let n = s.blocks.len();
    for mask in 0..1u32 << n {
        let x: Vec<bool> = (0..n).map(|i| mask >> i & 1 == 1).collect();
        let b = &s.blocks;
        let kf = |i: usize| if x[i] { b[i].kng } else { b[i].kg };
        let kb = |i: usize| if x[i] { b[i].out } else { b[i].krec };
        let mut want = Vec::new();
        for j in 0..n {
            let f = if x[j] { b[j].fng } else { b[j].fg };
            want.push(s.fixed + (0..j).map(kf).sum::<i64>() + f);
        }
        let all: i64 = (0..n).map(kb).sum();
        want.push(s.fixed + (0..n).map(kf).sum::<i64>() + s.lf);
        want.push(s.fixed + all + s.lk + s.lb);
        for j in (0..n).rev() {
            let base = s.fixed + (j + 1..n).map(|i| b[i].g).sum::<i64>() + (0..j).map(kb).sum::<i64>() + b[j].gout;
            let vjp = base + b[j].krec + if x[j] { b[j].btb } else { b[j].bta };
            // The phantom recompute moment when x_j = 0 must stay below vjp.
            let rec = if x[j] { base + b[j].frec } else { vjp - 1 };
            let got = ms[want.len()].eval(&x);
            if x[j] {
                assert_eq!(got, rec, "recompute {j} x={x:?}");
            } else {
                assert!(got < vjp, "phantom recompute {j} x={x:?}");
            }
            want.push(got);
            want.push(vjp);
        }
        want.push(s.fixed + b.iter().map(|b| b.g).sum::<i64>() + s.otmp);
        let got: Vec<i64> = ms.iter().map(|m| m.eval(&x)).collect();
        assert_eq!(got, want, "x={x:?}");
    }
}

/// Even with negative measured terms the phantom recompute moment never binds.
#[test]
fn phantom_recompute_never_binds() {
    let mut s = step();
    s.blocks[1].krec = 5;
    s.blocks[1].bta = -50;
    let ms = moments(&s);
    let x = [false, false, false];
    let rec = ms.iter().position(|m| m.label == "recompute b").unwrap();
    let vjp = ms.iter().position(|m| m.label == "backward b").unwrap();
    assert!(ms[rec].eval(&x) < ms[vjp].eval(&x));
}

#[test]
fn seconds_add_recompute_time() {
    let s = step();
    let t = step_seconds(&s, &[true, false, true]);
    assert!((t - 1.4).abs() < 1e-12);
}

/// A module called twice is two blocks of one name: the problem ties them (and their selective
/// variables), and the solver never checkpoints one call without the other.
#[test]
fn calls_of_one_module_are_tied() {
    let mut s = step();
    s.blocks[2].name = "a".into();
    for b in &mut s.blocks {
        b.sel = vec![SelTerms {
            kf: b.kg / 2,
            kb: b.krec / 2,
            fwd: b.fg,
            frec: b.frec,
            btb: b.btb,
            held: 0,
            recompute_seconds: b.recompute_seconds / 2.0,
        }];
    }
    let p = config_problem("tied", &s);
    assert_eq!(p.tied, vec![vec![0, 2], vec![3, 5]]);
    // With two policies, each call's variable of one policy is tied to the other call's of the
    // same policy, never across policies.
    let mut two = s.clone();
    for b in &mut two.blocks {
        let mut other = b.sel[0].clone();
        other.kb += 1;
        b.sel.push(other);
    }
    assert_eq!(
        config_problem("tied", &two).tied,
        vec![vec![0, 2], vec![3, 7], vec![4, 8]]
    );
    let q = permute(p.clone(), &step_order(&s));
    let order = step_order(&s);
    let min = crate::solver::min_peak(&q).unwrap();
    let mut checkpointed = 0;
    for budget in (min.peak..=1700).step_by(7) {
        let sol = crate::solver::solve_config(&q, budget).unwrap();
        let x = unpermute(&sol.x, &order);
        assert_eq!((x[0], x[3]), (x[2], x[5]), "budget {budget}: {x:?}");
        assert!(p.ties_hold(&x));
        checkpointed += usize::from(x[0] || x[3]);
    }
    assert!(checkpointed > 0, "no budget checkpointed the tied module");
}

/// A deep chain whose every layer keeps its output in its cache under one of two policies (bf16
/// BERT under `attention`): one `h` per layer, placed after the layer before it, keeps the
/// chain structure, so the exact DP solves it without falling back; and at a budget between
/// nothing and everything checkpointed, no plan has a layer plain after a holding one without
/// its `h` on.
#[test]
fn held_outputs_keep_the_chain_structure() {
    let mut s = step();
    s.blocks = (0..24).map(|i| block(&format!("layer.{i}"), 1)).collect();
    for b in &mut s.blocks {
        let sel = |kept: i64, held: i64, share: f64| SelTerms {
            kf: kept,
            kb: kept,
            fwd: b.fg,
            frec: b.frec / 2,
            btb: b.btb,
            held,
            recompute_seconds: b.recompute_seconds * share,
        };
        b.sel = vec![sel(b.kg / 2, 0, 0.5), sel(b.kg * 3 / 4, b.out, 0.1)];
    }
    // The last block (a pooler) is no candidate: a holding layer before it makes `h` on.
    s.blocks[23].candidate = false;
    s.blocks[23].sel.clear();
    let order = step_order(&s);
    let q = permute(config_problem("held", &s), &order);
    let min = crate::solver::min_peak(&q).unwrap();
    let all_plain = peak(&s, &with_selective(&s, &[false; 24], &[None; 24])).0;
    let mut held_on = 0;
    for k in 0..=8 {
        let budget = min.peak + (all_plain - min.peak) * k / 8;
        let opts = crate::solver::SolveOptions {
            engine: crate::solver::Engine::Dp,
            ..Default::default()
        };
        let sol = crate::solver::solve_config_with(&q, budget, opts).unwrap();
        let x = unpermute(&sol.x, &order);
        let (mask, policy) = split_selective(&s, &x);
        assert_eq!(
            with_selective(&s, &mask, &policy),
            x,
            "budget {budget}: h as the choice sets it"
        );
        assert!(peak(&s, &x).0 <= budget);
        held_on += x[24 + 46..].iter().filter(|&&h| h).count();
    }
    assert!(held_on > 0, "no plan ran a layer plain after a holding one");
}
