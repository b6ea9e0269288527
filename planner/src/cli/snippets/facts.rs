//! What the snippets need to know about a plan's model beyond the plan's fields: the family's
//! task model and backbone, and its repeated layers.

use ckptune_solver::formats::PlanJson;

/// What the snippets need to know about the model beyond the plan's fields: where a task
/// model keeps the backbone the plan's names are relative to, and which modules are layers.
pub(super) struct Facts {
    /// The submodule of the usual task model (`BertForSequenceClassification`,
    /// `GPT2LMHeadModel`, `LlamaForCausalLM`, a torchvision ResNet) whose names the plan uses.
    pub(super) backbone: String,
    /// What that task model is, for the comment.
    pub(super) task_model: &'static str,
    /// The repeated layers (`encoder.layer.N`, `h.N`, `model.layers.N`): Hugging Face's
    /// `GradientCheckpointingLayer`s.
    pub(super) layers: Vec<String>,
}

impl Facts {
    pub(super) fn of(plan: &PlanJson) -> Facts {
        let has = |name: &str| plan.model.modules.iter().any(|m| m == name);
        let numbered = |prefix: &str| -> Vec<String> {
            plan.model
                .modules
                .iter()
                .filter(|m| {
                    m.strip_prefix(prefix)
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                })
                .cloned()
                .collect()
        };
        // The families as ckptune loads them: their backbone's names without the task
        // model's prefix (BERT, GPT-2) or with the model's own (Llama's `model.`).
        if has("embeddings") && has("encoder.layer.0") {
            Facts {
                backbone: plan.model.backbone().to_owned(),
                task_model: "a Hugging Face BertForSequenceClassification",
                layers: numbered("encoder.layer."),
            }
        } else if has("wte") && has("h.0") {
            Facts {
                backbone: plan.model.backbone().to_owned(),
                task_model: "a Hugging Face GPT2LMHeadModel",
                layers: numbered("h."),
            }
        } else if has("model.embed_tokens") && has("model.layers.0") {
            Facts {
                backbone: plan.model.backbone().to_owned(),
                task_model: "a Hugging Face LlamaForCausalLM (Mistral, Qwen2)",
                layers: numbered("model.layers."),
            }
        } else {
            Facts {
                backbone: plan.model.backbone().to_owned(),
                task_model: "the model ckptune planned (a torchvision ResNet, your exported module)",
                layers: Vec::new(),
            }
        }
    }

    /// Whether every checkpointed module is a layer (and at least one is checkpointed).
    pub(super) fn only_layers(&self, plan: &PlanJson) -> bool {
        !plan.checkpoint.modules.is_empty() && plan.checkpoint.modules.iter().all(|m| self.layers.contains(m))
    }
}
