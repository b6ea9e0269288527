//! The profile document (`ckptune.profile/1`) and the model and device descriptions every
//! document shares. A profile's per-config measurements are [`ConfigProfile`] itself.

use serde::{Deserialize, Serialize};

use crate::profile::ConfigProfile;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockJson {
    pub name: String,
    pub candidate: bool,
}

/// A candidate module over blocks `first..=last` of the chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupJson {
    pub name: String,
    pub first: usize,
    pub last: usize,
}

impl ModelJson {
    /// The submodule of the usual task model whose module tree the names are from: `bert` for
    /// BERT (`BertForSequenceClassification.bert`), `transformer` for GPT-2
    /// (`GPT2LMHeadModel.transformer`), `""` where the names are the task model's own (Llama's
    /// `model.layers.N`, a torchvision ResNet, an exported module). The recorded prefix, else
    /// the families' rule for documents written before ckptune recorded it.
    pub fn backbone(&self) -> &str {
        match &self.prefix {
            Some(p) => p.trim_end_matches('.'),
            None => backbone_of(&self.modules),
        }
    }

    /// Names of the checkpoint units: blocks, then groups.
    pub fn unit_names(&self) -> impl Iterator<Item = &str> {
        self.blocks
            .iter()
            .map(|b| b.name.as_str())
            .chain(self.groups.iter().map(|g| g.name.as_str()))
    }
}

/// What a profile, sweep or plan was measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelJson {
    pub name: String,
    /// Parameters of the whole trained chain (loss head included) and of the reference model.
    pub params: i64,
    pub reference_params: i64,
    pub input: String,
    pub blocks: Vec<BlockJson>,
    /// Candidate modules spanning several blocks (`--granularity nested`); a checkpoint
    /// choice covers the blocks, then these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupJson>,
    /// Every qualified module name (the universe a checkpoint regex is checked against).
    pub modules: Vec<String>,
    /// Trainable parameters in `model.parameters()` order, with their shapes: what FSDP2
    /// shards (`plan --shard`). Empty in documents written before ckptune recorded them.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "parameters_json")]
    pub parameters: Vec<crate::shard::Parameter>,
    /// The attention implementation of a transformer ckptune built (`eager`, `sdpa`); absent
    /// for other models and in documents written before ckptune had a choice (eager).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
    /// The prefix the names have in the usual task model (`bert.`, `transformer.`, or `""`):
    /// what `ckptune.apply` looks under when given the whole task model ([`ModelJson::backbone`]).
    /// Absent in documents written before ckptune recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// The families as ckptune loads them: their backbone's names without the task model's prefix
/// (BERT, GPT-2), or with the model's own (Llama's `model.`).
pub fn backbone_of(modules: &[String]) -> &'static str {
    let has = |name: &str| modules.iter().any(|m| m == name);
    if has("embeddings") && has("encoder.layer.0") {
        "bert"
    } else if has("wte") && has("h.0") {
        "transformer"
    } else {
        ""
    }
}

/// `ModelJson.parameters` as `{"name", "shape", "element_bytes"}` objects; the shard model's
/// [`crate::shard::Parameter`] stays free of serde.
mod parameters_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::shard::Parameter;

    #[derive(Serialize, Deserialize)]
    struct ParameterJson {
        name: String,
        shape: Vec<i64>,
        element_bytes: i64,
    }

    pub fn serialize<S: Serializer>(params: &[Parameter], s: S) -> Result<S::Ok, S::Error> {
        params
            .iter()
            .map(|p| ParameterJson {
                name: p.name.clone(),
                shape: p.shape.clone(),
                element_bytes: p.element_bytes,
            })
            .collect::<Vec<_>>()
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Parameter>, D::Error> {
        Ok(Vec::<ParameterJson>::deserialize(d)?
            .into_iter()
            .map(|p| Parameter {
                name: p.name,
                shape: p.shape,
                element_bytes: p.element_bytes,
            })
            .collect())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceJson {
    pub device: String,
    pub threads: i32,
    pub memory: String,
    /// The CPU (model name and vector extensions): on CPU, kernels and so memory depend on it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cpu: String,
    /// How the profiles were measured (`--measure`): memory and times from real steps, or
    /// memory on the meta device with times from one real step or from the cost model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub measured: String,
}

impl DeviceJson {
    /// The device and its thread count as a person reads them: "cpu (1 thread)", "cpu (2 threads)".
    pub fn label(&self) -> String {
        let s = if self.threads == 1 { "" } else { "s" };
        format!("{} ({} thread{s})", self.device, self.threads)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileJson {
    pub format: String,
    pub ckptune_version: String,
    pub model: ModelJson,
    pub device: DeviceJson,
    pub repeats: usize,
    pub configs: Vec<ConfigProfile>,
}

/// One built-in model as `ckptune models --json` lists it (fields in alphabetical order, as
/// the listing has always been written).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelListing {
    pub candidates: Vec<String>,
    pub family: String,
    pub name: String,
    pub reference_params: i64,
}
