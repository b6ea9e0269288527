//! Each rank's step under PyTorch FSDP2 (`fully_shard` on every unit, then on the root), as
//! affine moments of the checkpoint choice: the single-process chain model
//! ([`crate::chain_model`]) with FSDP's sharding rules added at every moment. docs/fsdp.md
//! measures the rules on real multi-process runs and derives each term used here.
//!
//! Per unit `u` (a candidate block; the root holds every other parameter) over N ranks:
//! `P_u` its padded unsharded bytes (each parameter's dim 0 padded to a multiple of N), the
//! size of its all-gather buffer `F_u`, its unsharded parameters `U_u` and its reduce-scatter
//! input `RS_u`; `S_u = P_u / N` its shard, also the size of its sharded gradients; `L_u(r)`
//! rank r's unpadded chunk, what the optimizer state covers; `G_u` its unsharded gradients.

/// One trainable parameter as FSDP2 shards it: on its own, along dim 0.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Parameter {
    /// Qualified name, as `model.named_parameters()` gives it (`layer1.0.conv1.weight`).
    pub name: String,
    pub shape: Vec<i64>,
    pub element_bytes: i64,
}

impl Parameter {
    fn dim0(&self) -> i64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Bytes of one dim-0 row (the whole tensor for a scalar).
    fn row_bytes(&self) -> i64 {
        self.shape.iter().skip(1).product::<i64>() * self.element_bytes
    }

    /// Unsharded bytes.
    pub fn bytes(&self) -> i64 {
        self.dim0() * self.row_bytes()
    }

    /// Rows of each rank's chunk (`torch.chunk`: ceil-sized chunks, the last ones short or
    /// empty) and the padded rows every rank allocates.
    fn rows(&self, ranks: i64, rank: i64) -> (i64, i64) {
        let per = (self.dim0() + ranks - 1) / ranks;
        ((self.dim0() - rank * per).clamp(0, per), per)
    }

    /// Rank `rank`'s unpadded chunk and its padded shard, in bytes.
    pub fn shard_bytes(&self, ranks: i64, rank: i64) -> (i64, i64) {
        let (own, padded) = self.rows(ranks, rank);
        (own * self.row_bytes(), padded * self.row_bytes())
    }
}

/// Whose collectives run the all-gathers and reduce-scatters: gloo (CPU) allocates a temporary
/// of the all-gather's output and of the reduce-scatter's input (plus 12 bytes); NCCL (CUDA)
/// works in FSDP's own buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    Gloo,
    Nccl,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::Gloo => "gloo",
            Collective::Nccl => "nccl",
        }
    }
}

/// How a plan shards: N ranks, `reshard_after_forward` of every unit, the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    pub ranks: i64,
    pub reshard_after_forward: bool,
    pub collective: Collective,
}
