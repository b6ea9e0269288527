//! How a checkpoint mask runs a chain: which blocks form a checkpointed segment (a block, or a
//! checkpointed group's run), which run fused as one graph (a group with nothing checkpointed),
//! and after which block each output (and further output) is dead inside a segment.

use ckptune_kernels::sac::SacPolicy;
use ckptune_models::Chain;

/// The plan of one micro-step's execution for a checkpoint mask.
pub(super) struct Schedule {
    /// Per block: the checkpointed segment `(first, last)` it belongs to, if any.
    pub segments: Vec<Option<(usize, usize)>>,
    /// Per block: the group `(first, last)` it runs fused in, if any.
    pub fused: Vec<Option<(usize, usize)>>,
    /// Per block: the block after which its output is dead during a segment's no-grad forward
    /// (its last reader within the segment).
    pub last_reader: Vec<usize>,
    /// Per further output `(block, slot)` read inside a segment or fused group, the block after
    /// which it is dead there (its last reader).
    pub further_last_reader: Vec<((usize, usize), usize)>,
    /// Per block: its output's only reader is the next block (no skip, not the loss), so the
    /// runtime lets go of it after that reader's forward, or its backward when it recomputes
    /// ([`super::boundary::release_output`]). Other outputs are held until their block's
    /// backward.
    pub single_reader: Vec<bool>,
    /// Per block: the policy it runs selective under, for a block checkpointed on its own
    /// whose session asks for it ([`super::Session::selective`]).
    pub selective: Vec<Option<SacPolicy>>,
}

impl Schedule {
    /// The schedule of `checkpoint` (over [`Chain::units`]); `fuse_groups` off runs every group
    /// as its blocks.
    pub fn new(chain: &Chain, checkpoint: &[bool], fuse_groups: bool, selective: &[Option<SacPolicy>]) -> Self {
        let n = chain.blocks.len();
        let mut last_reader: Vec<usize> = (0..n).map(|k| k + 1).collect();
        let mut further_last_reader: Vec<((usize, usize), usize)> = Vec::new();
        for (i, b) in chain.blocks.iter().enumerate() {
            for &s in &b.skips {
                last_reader[s] = last_reader[s].max(i);
            }
            for &r in &b.extra_reads {
                match further_last_reader.iter_mut().find(|(e, _)| *e == r) {
                    Some((_, last)) => *last = i,
                    None => further_last_reader.push((r, i)),
                }
            }
        }
        let loss_reads = chain.head.all_reads();
        let single_reader = (0..n)
            .map(|k| k + 1 < n && last_reader[k] == k + 1 && !loss_reads.contains(&(k, 0)))
            .collect();
        let segments = segments(chain, checkpoint);
        let selective = (0..n)
            .map(|i| {
                selective
                    .get(i)
                    .copied()
                    .flatten()
                    .filter(|_| segments[i] == Some((i, i)))
            })
            .collect();
        Schedule {
            segments,
            fused: if fuse_groups {
                fused_groups(chain, checkpoint)
            } else {
                vec![None; n]
            },
            last_reader,
            further_last_reader,
            single_reader,
            selective,
        }
    }
}

/// Per block: the group `(first, last)` it runs fused in, if any: a group that is not
/// checkpointed and none of whose blocks is.
fn fused_groups(chain: &Chain, checkpoint: &[bool]) -> Vec<Option<(usize, usize)>> {
    let n = chain.blocks.len();
    let mut out = vec![None; n];
    for (g, grp) in chain.groups.iter().enumerate() {
        if !checkpoint[n + g] && !checkpoint[grp.first..=grp.last].contains(&true) {
            for s in &mut out[grp.first..=grp.last] {
                *s = Some((grp.first, grp.last));
            }
        }
    }
    out
}

/// Per block: the checkpointed segment `(first, last)` it belongs to, if any.
fn segments(chain: &Chain, checkpoint: &[bool]) -> Vec<Option<(usize, usize)>> {
    let n = chain.blocks.len();
    let mut seg: Vec<Option<(usize, usize)>> = (0..n).map(|i| checkpoint[i].then_some((i, i))).collect();
    for (g, grp) in chain.groups.iter().enumerate() {
        if checkpoint[n + g] {
            for s in &mut seg[grp.first..=grp.last] {
                *s = Some((grp.first, grp.last));
            }
        }
    }
    seg
}
