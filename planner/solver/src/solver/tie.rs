//! Tied variables (a module's calls, [`ConfigProblem::tied`]) as one: the engines search a
//! problem in which each class is its first variable, carrying the class's summed coefficients
//! and times, the others fixed off; the answer is copied back over each class. A moment's value
//! under an untied choice equals the tied problem's under the copied one, byte for byte, so
//! every engine stays exact without knowing about ties.

use crate::problem::{ConfigProblem, Moment, Occurs};

/// The untied problem and, per variable, the variable standing for its class.
pub(super) fn untie(p: &ConfigProblem) -> (ConfigProblem, Vec<usize>) {
    let n = p.candidate.len();
    let rep = representatives(n, &p.tied);
    let merge = |v: &[i64]| {
        let mut out = vec![0; n];
        for (i, &c) in v.iter().enumerate() {
            out[rep[i]] += c;
        }
        out
    };
    let mut seconds_coef = vec![0.0; n];
    let mut candidate = vec![true; n];
    for i in 0..n {
        seconds_coef[rep[i]] += p.seconds_coef[i];
        candidate[rep[i]] &= p.candidate[i];
    }
    let mut exclusive = Vec::with_capacity(p.exclusive.len());
    for g in &p.exclusive {
        let mut members = g.clone();
        members.sort_unstable();
        members.dedup();
        let mut reps: Vec<usize> = members.iter().map(|&i| rep[i]).collect();
        reps.sort_unstable();
        // Two members of one class in one exclusive group: that class can never be on.
        for w in reps.windows(2).filter(|w| w[0] == w[1]) {
            candidate[w[0]] = false;
        }
        reps.dedup();
        exclusive.push(reps);
    }
    for (i, c) in candidate.iter_mut().enumerate() {
        *c &= rep[i] == i;
    }
    let moments = p
        .moments
        .iter()
        .map(|m| Moment {
            label: m.label.clone(),
            constant: m.constant,
            coef: merge(&m.coef),
            occurs: match &m.occurs {
                Occurs::When(conds) => Occurs::When(conds.iter().map(|&(v, on)| (rep[v], on)).collect()),
                other => other.clone(),
            },
        })
        .collect();
    let q = ConfigProblem {
        key: p.key.clone(),
        moments,
        seconds_base: p.seconds_base,
        seconds_coef,
        candidate,
        exclusive,
        tied: Vec::new(),
    };
    (q, rep)
}

/// A choice of the untied problem over every variable of its class.
pub(super) fn retie(x: &[bool], rep: &[usize]) -> Vec<bool> {
    rep.iter().map(|&r| x[r]).collect()
}

/// Per variable, the smallest variable of its class (classes that share a variable are one).
fn representatives(n: usize, tied: &[Vec<usize>]) -> Vec<usize> {
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for class in tied {
        for w in class.windows(2) {
            let (a, b) = (root(&mut parent, w[0]), root(&mut parent, w[1]));
            parent[a.max(b)] = a.min(b);
        }
    }
    (0..n).map(|i| root(&mut parent, i)).collect()
}
