//! Exact dynamic program over the blocks in order, for moment lists with chain structure.
//!
//! Why it exists: microlp's branch and bound has no cutting planes, and a chain of
//! identical blocks (every BERT layer, every bottleneck of a ResNet stage, to the byte)
//! makes thousands of choices cost within a few percent of each other; proving one
//! optimal took it 72 s at 24 blocks. The chain model gives this program a tiny state.
//!
//! State after deciding blocks `0..q`: for every moment still open (with a nonzero
//! coefficient at some block ≥ q), the partial sum `Σ_{p<q} coef_p x_p`. Moments whose
//! coefficients agree on `0..q` share that sum, so the state is one sum per *class* of such
//! moments. In the chain model (docs/memory-model.md) every forward moment has the prefix `kf`, and the loss,
//! recompute and backward moments the prefix `kb`, so there are at most two classes
//! (one in fp32, where the two prefixes coincide). A state is dropped when it is
//! dominated — another state with the same exclusive groups in use, no larger sums and
//! no larger time — or when even the most favourable remaining choices cannot bring some
//! moment under the limit. Every comparison is exact `i64`; only time is `f64`.
//!
//! The structure is discovered from the coefficients, not assumed: if classes or the
//! dominance front grow beyond fixed caps the program gives up and the caller uses the
//! MILP.

use std::collections::BTreeMap;

use super::presolve::Reduced;

/// More classes than this means the moments lack chain structure.
const MAX_CLASSES: usize = 8;
/// Largest dominance front kept per block before giving up.
const MAX_FRONT: usize = 200_000;
/// Largest set of candidate states filtered by pairwise dominance (three or more classes).
const MAX_PAIRWISE: usize = 20_000;
/// Exclusive groups open at the same block are tracked as bits of a `u64`.
const MAX_GROUPS: usize = 64;

pub(super) enum Outcome {
    /// Choice over the free blocks.
    Found(Vec<bool>),
    Infeasible,
    /// The state would be too large; the message says which cap was hit.
    TooLarge(String),
}

struct Class {
    /// Rows (indices into `Reduced::rows`) sharing this prefix.
    rows: Vec<usize>,
    /// Index of the class at the previous block this one was split from.
    parent: usize,
    /// Coefficient of the block just decided, common to every row of the class.
    delta: i64,
    /// Largest `offset + (most favourable remaining contribution)` over the rows: a state
    /// whose sum plus this exceeds the limit can never become feasible.
    need: i64,
}

/// Minimize `Σ t_q y_q` (or, with `minimize_time == false`, find any point) over the free
/// blocks subject to every row ≤ `limit` and the exclusive groups.
pub(super) fn solve(red: &Reduced, t: &[f64], limit: i64, minimize_time: bool) -> Outcome {
    let k = red.free.len();
    let rows = &red.rows;
    // Dense per-row coefficient lookup is k·rows i64; fine for the sizes that reach here
    // (300 blocks × 900 moments = 2 MiB).
    let mut dense = vec![0i64; rows.len() * k];
    let mut end = vec![usize::MAX; rows.len()];
    for (r, row) in rows.iter().enumerate() {
        for &(q, c) in &row.coef {
            dense[r * k + q] = c;
            end[r] = q;
        }
    }
    let coef = |r: usize, q: usize| dense[r * k + q];
    // Most favourable contribution of blocks ≥ q, per row, updated as q advances.
    let mut rem_neg: Vec<i64> = rows
        .iter()
        .map(|row| row.coef.iter().map(|&(_, c)| c.min(0)).sum())
        .collect();

    // Rows without free coefficients are fixed numbers.
    if rows
        .iter()
        .enumerate()
        .any(|(r, row)| end[r] == usize::MAX && row.offset > limit)
    {
        return Outcome::Infeasible;
    }
    let open: Vec<usize> = (0..rows.len()).filter(|&r| end[r] != usize::MAX).collect();
    let mut classes: Vec<Class> = Vec::new();
    if !open.is_empty() {
        let need = open
            .iter()
            .map(|&r| rows[r].offset + rem_neg[r])
            .max()
            .expect("non-empty");
        if need > limit {
            return Outcome::Infeasible;
        }
        classes.push(Class {
            rows: open,
            parent: 0,
            delta: 0,
            need,
        });
    }

    // Exclusive groups as bits of a u64. Only later members need to see that an earlier one
    // was taken, so a member sets the bit unless it is its group's last, and checks it unless
    // it is the first. Pairs with the same first member (a nested candidate and each of its
    // blocks) share one bit, set by that member and checked by the others: a layer of 36
    // blocks is two bits, not 72. A bit is reused once its groups have closed (interval
    // colouring by first member), so only bits open at the same block count against
    // MAX_GROUPS.
    struct Bit {
        first: usize,
        last: usize,
        setters: Vec<usize>,
        checkers: Vec<usize>,
    }
    let mut bits: Vec<Bit> = Vec::new();
    let mut star: BTreeMap<usize, usize> = BTreeMap::new();
    for members in &red.groups {
        let mut m = members.clone();
        m.sort_unstable();
        m.dedup();
        let (Some(&first), Some(&last)) = (m.first(), m.last()) else {
            continue;
        };
        if m.len() == 2 {
            if let Some(&b) = star.get(&first) {
                bits[b].last = bits[b].last.max(last);
                bits[b].checkers.push(last);
                continue;
            }
            star.insert(first, bits.len());
        }
        bits.push(Bit {
            first,
            last,
            setters: m[..m.len() - 1].to_vec(),
            checkers: m[1..].to_vec(),
        });
    }
    let mut by_first: Vec<usize> = (0..bits.len()).collect();
    by_first.sort_by_key(|&g| (bits[g].first, bits[g].last));
    let mut slot_end: Vec<usize> = Vec::new();
    let mut slot = vec![0usize; bits.len()];
    for g in by_first {
        let (first, last) = (bits[g].first, bits[g].last);
        match slot_end.iter().position(|&e| e < first) {
            Some(s) => {
                slot[g] = s;
                slot_end[s] = last;
            }
            None if slot_end.len() < MAX_GROUPS => {
                slot[g] = slot_end.len();
                slot_end.push(last);
            }
            None => return Outcome::TooLarge(format!("more than {MAX_GROUPS} exclusive groups open at block {first}")),
        }
    }
    let mut set_at: Vec<u64> = vec![0; k];
    let mut check_at: Vec<u64> = vec![0; k];
    for (g, bit) in bits.iter().enumerate() {
        for &q in &bit.setters {
            set_at[q] |= 1 << slot[g];
        }
        for &q in &bit.checkers {
            check_at[q] |= 1 << slot[g];
        }
    }
    let span: Vec<(usize, usize)> = bits.iter().map(|b| (b.first, b.last)).collect();

    // Current front: per state its sums (stride d), group mask, time and history index.
    let mut d = classes.len();
    let mut sig: Vec<i64> = vec![0; d];
    let mut mask: Vec<u64> = vec![0];
    let mut cost: Vec<f64> = vec![0.0];
    let mut hist: Vec<u32> = vec![u32::MAX];
    // History for reconstruction: (parent history index, took block q).
    let mut history: Vec<(u32, bool)> = Vec::new();

    for q in 0..k {
        // Split classes by this block's coefficient; check rows that close here.
        let mut next: Vec<Class> = Vec::new();
        let mut close_max: Vec<[i64; 2]> = Vec::with_capacity(classes.len());
        for (ci, c) in classes.iter().enumerate() {
            let mut cm = [i64::MIN; 2];
            let mut split: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
            for &r in &c.rows {
                let a = coef(r, q);
                if end[r] == q {
                    cm[0] = cm[0].max(rows[r].offset);
                    cm[1] = cm[1].max(rows[r].offset + a);
                } else {
                    split.entry(a).or_default().push(r);
                }
            }
            close_max.push(cm);
            for (a, rs) in split {
                next.push(Class {
                    rows: rs,
                    parent: ci,
                    delta: a,
                    need: i64::MIN,
                });
            }
        }
        for (r, rn) in rem_neg.iter_mut().enumerate() {
            *rn -= coef(r, q).min(0);
        }
        for c in &mut next {
            c.need = c
                .rows
                .iter()
                .map(|&r| rows[r].offset + rem_neg[r])
                .max()
                .expect("classes are non-empty");
        }
        if next.len() > MAX_CLASSES {
            return Outcome::TooLarge(format!(
                "{} classes of moments at block {q} (at most {MAX_CLASSES})",
                next.len()
            ));
        }
        let open_after: u64 = span
            .iter()
            .zip(&slot)
            .filter(|&(&(first, last), _)| first <= q && last > q)
            .fold(0, |m, (_, &s)| m | 1 << s);

        // Expand every state by y ∈ {0, 1}.
        let nd = next.len();
        let mut c_sig: Vec<i64> = Vec::with_capacity(2 * cost.len() * nd);
        let mut c_mask: Vec<u64> = Vec::with_capacity(2 * cost.len());
        let mut c_cost: Vec<f64> = Vec::with_capacity(2 * cost.len());
        let mut c_hist: Vec<(u32, bool)> = Vec::with_capacity(2 * cost.len());
        let mut buf = vec![0i64; nd];
        for s in 0..cost.len() {
            let sv = &sig[s * d..(s + 1) * d];
            'y: for y in [false, true] {
                if y && mask[s] & check_at[q] != 0 {
                    continue;
                }
                let yi = usize::from(y);
                for (ci, cm) in close_max.iter().enumerate() {
                    if cm[yi] != i64::MIN && sv[ci] + cm[yi] > limit {
                        continue 'y;
                    }
                }
                for (b, c) in buf.iter_mut().zip(&next) {
                    *b = sv[c.parent] + if y { c.delta } else { 0 };
                    if *b + c.need > limit {
                        continue 'y;
                    }
                }
                c_sig.extend_from_slice(&buf);
                c_mask.push((mask[s] | if y { set_at[q] } else { 0 }) & open_after);
                c_cost.push(if minimize_time && y { cost[s] + t[q] } else { cost[s] });
                c_hist.push((hist[s], y));
            }
        }
        if c_cost.is_empty() {
            return Outcome::Infeasible;
        }
        // Beyond two classes dominance is tested pairwise, quadratic in the front.
        if nd > 2 && c_cost.len() > MAX_PAIRWISE {
            return Outcome::TooLarge(format!(
                "{} states over {nd} classes at block {q} (pairwise dominance handles {MAX_PAIRWISE})",
                c_cost.len()
            ));
        }
        let keep = pareto(&c_sig, &c_mask, &c_cost, nd);
        if keep.len() > MAX_FRONT {
            return Outcome::TooLarge(format!(
                "{} non-dominated states at block {q} (at most {MAX_FRONT})",
                keep.len()
            ));
        }
        sig.clear();
        mask.clear();
        cost.clear();
        hist.clear();
        for &i in &keep {
            sig.extend_from_slice(&c_sig[i * nd..(i + 1) * nd]);
            mask.push(c_mask[i]);
            cost.push(c_cost[i]);
            hist.push(history.len() as u32);
            history.push(c_hist[i]);
        }
        classes = next;
        d = nd;
    }

    // Every surviving state satisfies every row; take the fastest (first on ties).
    let best = (0..cost.len())
        .min_by(|&a, &b| cost[a].total_cmp(&cost[b]))
        .expect("front is non-empty");
    let mut y = vec![false; k];
    let mut h = hist[best];
    for q in (0..k).rev() {
        let (parent, took) = history[h as usize];
        y[q] = took;
        h = parent;
    }
    Outcome::Found(y)
}

/// Indices of the candidates no other candidate dominates (one representative per set of
/// identical ones). Dominance is only tested within equal group masks: a state using
/// fewer groups may also dominate, but missing that only costs time, not exactness.
fn pareto(sig: &[i64], mask: &[u64], cost: &[f64], d: usize) -> Vec<usize> {
    let n = cost.len();
    let mut order: Vec<usize> = (0..n).collect();
    // Cheapest first, so a candidate can only be dominated by one already kept.
    order.sort_by(|&a, &b| {
        mask[a]
            .cmp(&mask[b])
            .then(cost[a].total_cmp(&cost[b]))
            .then_with(|| sig[a * d..(a + 1) * d].cmp(&sig[b * d..(b + 1) * d]))
    });
    let mut keep = Vec::new();
    let mut start = 0;
    while start < n {
        let m = mask[order[start]];
        let stop = order[start..]
            .iter()
            .position(|&i| mask[i] != m)
            .map_or(n, |p| start + p);
        let run = &order[start..stop];
        match d {
            0 => keep.push(run[0]),
            1 => {
                // Cheapest first: keep a state only if its sum beats every cheaper one.
                let mut best = i64::MAX;
                for &i in run {
                    if sig[i] < best {
                        best = sig[i];
                        keep.push(i);
                    }
                }
            }
            2 => {
                // Staircase of kept (σ0 → smallest σ1 among kept with that σ0 or less).
                let mut stair: BTreeMap<i64, i64> = BTreeMap::new();
                for &i in run {
                    let (a, b) = (sig[2 * i], sig[2 * i + 1]);
                    if stair.range(..=a).next_back().is_some_and(|(_, &mb)| mb <= b) {
                        continue;
                    }
                    keep.push(i);
                    let dominated: Vec<i64> = stair
                        .range(a..)
                        .take_while(|&(_, &mb)| mb >= b)
                        .map(|(&ka, _)| ka)
                        .collect();
                    for ka in dominated {
                        stair.remove(&ka);
                    }
                    stair.insert(a, b);
                }
            }
            _ => {
                let first = keep.len();
                for &i in run {
                    let si = &sig[i * d..(i + 1) * d];
                    let dominated = keep[first..]
                        .iter()
                        .any(|&j| sig[j * d..(j + 1) * d].iter().zip(si).all(|(a, b)| a <= b));
                    if !dominated {
                        keep.push(i);
                    }
                }
            }
        }
        start = stop;
    }
    keep
}
