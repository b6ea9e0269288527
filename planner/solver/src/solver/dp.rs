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

use super::presolve::{Reduced, Row};

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
    match search(red, t, limit, minimize_time) {
        Ok(y) => Outcome::Found(y),
        Err(outcome) => outcome,
    }
}

/// The program, block by block: the classes split, the front expanded and pruned; `Err` with
/// the outcome when it stops early.
fn search(red: &Reduced, t: &[f64], limit: i64, minimize_time: bool) -> Result<Vec<bool>, Outcome> {
    let k = red.free.len();
    let table = Table::new(red);
    // Most favourable contribution of blocks ≥ q, per row, updated as q advances.
    let mut rem_neg: Vec<i64> = red
        .rows
        .iter()
        .map(|row| row.coef.iter().map(|&(_, c)| c.min(0)).sum())
        .collect();
    let mut classes = first_classes(&table, &rem_neg, limit)?;
    let exclusive = Exclusive::new(&red.groups, k)?;
    let mut front = Front::start(classes.len());
    // History for reconstruction: (parent history index, took block q).
    let mut history: Vec<(u32, bool)> = Vec::new();
    for (q, &time) in t.iter().enumerate().take(k) {
        for (r, rn) in rem_neg.iter_mut().enumerate() {
            *rn -= table.coef(r, q).min(0);
        }
        let (next, close_max) = split_classes(&classes, &table, &rem_neg, q)?;
        let decision = Decision {
            next: &next,
            close_max: &close_max,
            check: exclusive.check_at[q],
            set: exclusive.set_at[q],
            open_after: exclusive.open_after(q),
            time,
            minimize_time,
            limit,
        };
        front = front.expand(&decision).prune(q, &mut history)?;
        classes = next;
    }
    Ok(front.best_choice(&history, k))
}

/// Every row's coefficients as a dense `rows × k` table, and the last block each row reads.
struct Table<'a> {
    rows: &'a [Row],
    k: usize,
    dense: Vec<i64>,
    /// Last free block with a nonzero coefficient; `usize::MAX` for a row with none.
    end: Vec<usize>,
}

impl<'a> Table<'a> {
    /// Dense per-row coefficient lookup is k·rows i64; fine for the sizes that reach here
    /// (300 blocks × 900 moments = 2 MiB).
    fn new(red: &'a Reduced) -> Self {
        let (rows, k) = (&red.rows, red.free.len());
        let mut dense = vec![0i64; rows.len() * k];
        let mut end = vec![usize::MAX; rows.len()];
        for (r, row) in rows.iter().enumerate() {
            for &(q, c) in &row.coef {
                dense[r * k + q] = c;
                end[r] = q;
            }
        }
        Table { rows, k, dense, end }
    }

    fn coef(&self, r: usize, q: usize) -> i64 {
        self.dense[r * self.k + q]
    }
}

/// The rows still open before block 0, as one class; `Err` when some row exceeds the limit
/// whatever is chosen.
fn first_classes(table: &Table<'_>, rem_neg: &[i64], limit: i64) -> Result<Vec<Class>, Outcome> {
    let (rows, end) = (table.rows, &table.end);
    // Rows without free coefficients are fixed numbers.
    if rows
        .iter()
        .enumerate()
        .any(|(r, row)| end[r] == usize::MAX && row.offset > limit)
    {
        return Err(Outcome::Infeasible);
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
            return Err(Outcome::Infeasible);
        }
        classes.push(Class {
            rows: open,
            parent: 0,
            delta: 0,
            need,
        });
    }
    Ok(classes)
}

/// Exclusive groups as bits of a u64. Only later members need to see that an earlier one
/// was taken, so a member sets the bit unless it is its group's last, and checks it unless
/// it is the first. Pairs with the same first member (a nested candidate and each of its
/// blocks) share one bit, set by that member and checked by the others: a layer of 36
/// blocks is two bits, not 72. A bit is reused once its groups have closed (interval
/// colouring by first member), so only bits open at the same block count against
/// MAX_GROUPS.
struct Exclusive {
    /// Per block: the bits it sets when taken, and the bits that forbid taking it.
    set_at: Vec<u64>,
    check_at: Vec<u64>,
    /// Per group bit: its first and last member, and its slot in the `u64`.
    span: Vec<(usize, usize)>,
    slot: Vec<usize>,
}

struct Bit {
    first: usize,
    last: usize,
    setters: Vec<usize>,
    checkers: Vec<usize>,
}

impl Exclusive {
    fn new(groups: &[Vec<usize>], k: usize) -> Result<Self, Outcome> {
        let bits = Self::bits(groups);
        let slot = Self::slots(&bits)?;
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
        Ok(Exclusive {
            set_at,
            check_at,
            span: bits.iter().map(|b| (b.first, b.last)).collect(),
            slot,
        })
    }

    /// One bit per group, pairs sharing their first member merged.
    fn bits(groups: &[Vec<usize>]) -> Vec<Bit> {
        let mut bits: Vec<Bit> = Vec::new();
        let mut star: BTreeMap<usize, usize> = BTreeMap::new();
        for members in groups {
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
        bits
    }

    /// Each bit's slot in the `u64`, by interval colouring in order of first member.
    fn slots(bits: &[Bit]) -> Result<Vec<usize>, Outcome> {
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
                None => {
                    return Err(Outcome::TooLarge(format!(
                        "more than {MAX_GROUPS} exclusive groups open at block {first}"
                    )))
                }
            }
        }
        Ok(slot)
    }

    /// The bits of the groups still open after block `q`.
    fn open_after(&self, q: usize) -> u64 {
        self.span
            .iter()
            .zip(&self.slot)
            .filter(|&(&(first, last), _)| first <= q && last > q)
            .fold(0, |m, (_, &s)| m | 1 << s)
    }
}

/// The classes after a block, and the closing rows' highest values per class before it.
type Split = (Vec<Class>, Vec<[i64; 2]>);

/// The classes after block `q`: each split by its rows' coefficient at `q`, the rows that
/// close at `q` left out, each with its `need` from `rem_neg` (the rows' most favourable
/// contributions after `q`); and per class before, the highest closing row without and with
/// block `q` (`i64::MIN` when none closes).
fn split_classes(classes: &[Class], table: &Table<'_>, rem_neg: &[i64], q: usize) -> Result<Split, Outcome> {
    let mut next: Vec<Class> = Vec::new();
    let mut close_max: Vec<[i64; 2]> = Vec::with_capacity(classes.len());
    for (ci, c) in classes.iter().enumerate() {
        let mut cm = [i64::MIN; 2];
        let mut split: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
        for &r in &c.rows {
            let a = table.coef(r, q);
            if table.end[r] == q {
                cm[0] = cm[0].max(table.rows[r].offset);
                cm[1] = cm[1].max(table.rows[r].offset + a);
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
    for c in &mut next {
        c.need = c
            .rows
            .iter()
            .map(|&r| table.rows[r].offset + rem_neg[r])
            .max()
            .expect("classes are non-empty");
    }
    if next.len() > MAX_CLASSES {
        return Err(Outcome::TooLarge(format!(
            "{} classes of moments at block {q} (at most {MAX_CLASSES})",
            next.len()
        )));
    }
    Ok((next, close_max))
}

/// Block `q` as the expansion of the front sees it.
struct Decision<'a> {
    next: &'a [Class],
    close_max: &'a [[i64; 2]],
    /// Exclusive-group bits that forbid taking `q`, that taking it sets, still open after it.
    check: u64,
    set: u64,
    open_after: u64,
    time: f64,
    minimize_time: bool,
    limit: i64,
}

/// The current front: per state its sums (stride `d`), group mask, time and history index.
struct Front {
    d: usize,
    sig: Vec<i64>,
    mask: Vec<u64>,
    cost: Vec<f64>,
    hist: Vec<u32>,
}

/// States after one more block, before dominance: `hist` holds (parent history index, took
/// the block).
struct Candidates {
    d: usize,
    sig: Vec<i64>,
    mask: Vec<u64>,
    cost: Vec<f64>,
    hist: Vec<(u32, bool)>,
}

impl Front {
    /// The one state before any block: every sum 0.
    fn start(d: usize) -> Self {
        Front {
            d,
            sig: vec![0; d],
            mask: vec![0],
            cost: vec![0.0],
            hist: vec![u32::MAX],
        }
    }

    /// Every state expanded by y ∈ {0, 1}, keeping those that can still fit.
    fn expand(&self, b: &Decision<'_>) -> Candidates {
        let (d, nd) = (self.d, b.next.len());
        let mut c = Candidates {
            d: nd,
            sig: Vec::with_capacity(2 * self.cost.len() * nd),
            mask: Vec::with_capacity(2 * self.cost.len()),
            cost: Vec::with_capacity(2 * self.cost.len()),
            hist: Vec::with_capacity(2 * self.cost.len()),
        };
        let mut buf = vec![0i64; nd];
        for s in 0..self.cost.len() {
            let sv = &self.sig[s * d..(s + 1) * d];
            'y: for y in [false, true] {
                if y && self.mask[s] & b.check != 0 {
                    continue;
                }
                let yi = usize::from(y);
                for (ci, cm) in b.close_max.iter().enumerate() {
                    if cm[yi] != i64::MIN && sv[ci] + cm[yi] > b.limit {
                        continue 'y;
                    }
                }
                for (v, class) in buf.iter_mut().zip(b.next) {
                    *v = sv[class.parent] + if y { class.delta } else { 0 };
                    if *v + class.need > b.limit {
                        continue 'y;
                    }
                }
                c.sig.extend_from_slice(&buf);
                c.mask.push((self.mask[s] | if y { b.set } else { 0 }) & b.open_after);
                c.cost.push(if b.minimize_time && y {
                    self.cost[s] + b.time
                } else {
                    self.cost[s]
                });
                c.hist.push((self.hist[s], y));
            }
        }
        c
    }

    /// Every surviving state satisfies every row; the choice of the fastest (first on ties).
    fn best_choice(&self, history: &[(u32, bool)], k: usize) -> Vec<bool> {
        let best = (0..self.cost.len())
            .min_by(|&a, &b| self.cost[a].total_cmp(&self.cost[b]))
            .expect("front is non-empty");
        let mut y = vec![false; k];
        let mut h = self.hist[best];
        for q in (0..k).rev() {
            let (parent, took) = history[h as usize];
            y[q] = took;
            h = parent;
        }
        y
    }
}

impl Candidates {
    /// The next front: the candidates no other dominates, their history appended to
    /// `history`; `Err` when none is left or the front outgrows its caps.
    fn prune(self, q: usize, history: &mut Vec<(u32, bool)>) -> Result<Front, Outcome> {
        let nd = self.d;
        if self.cost.is_empty() {
            return Err(Outcome::Infeasible);
        }
        // Beyond two classes dominance is tested pairwise, quadratic in the front.
        if nd > 2 && self.cost.len() > MAX_PAIRWISE {
            return Err(Outcome::TooLarge(format!(
                "{} states over {nd} classes at block {q} (pairwise dominance handles {MAX_PAIRWISE})",
                self.cost.len()
            )));
        }
        let keep = pareto(&self.sig, &self.mask, &self.cost, nd);
        if keep.len() > MAX_FRONT {
            return Err(Outcome::TooLarge(format!(
                "{} non-dominated states at block {q} (at most {MAX_FRONT})",
                keep.len()
            )));
        }
        let mut front = Front {
            d: nd,
            sig: Vec::new(),
            mask: Vec::new(),
            cost: Vec::new(),
            hist: Vec::new(),
        };
        for &i in &keep {
            front.sig.extend_from_slice(&self.sig[i * nd..(i + 1) * nd]);
            front.mask.push(self.mask[i]);
            front.cost.push(self.cost[i]);
            front.hist.push(history.len() as u32);
            history.push(self.hist[i]);
        }
        Ok(front)
    }
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
