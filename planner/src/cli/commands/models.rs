//! `ckptune models`: the built-in models with their candidates and parameter counts.

use std::process::ExitCode;

use anyhow::Result;
use ckptune_solver::formats::ModelListing;

use crate::cli::output::{group_digits, outln, print_json};

pub fn models(json: bool) -> Result<ExitCode> {
    let list = ckptune_models::list();
    if json {
        let v: Vec<ModelListing> = list
            .iter()
            .map(|m| ModelListing {
                candidates: m.candidates.clone(),
                family: format!("{:?}", m.family),
                name: m.name.to_string(),
                reference_params: m.reference_params,
            })
            .collect();
        print_json(&v)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{:<20} {:<8} {:>14}  candidates", "model", "family", "parameters");
    for m in list {
        let c = &m.candidates;
        let shown = if c.len() > 6 {
            format!("{}, {}, … {} ({} blocks)", c[0], c[1], c[c.len() - 1], c.len())
        } else {
            c.join(", ")
        };
        outln!(
            "{:<20} {:<8} {:>14}  {}",
            m.name,
            format!("{:?}", m.family),
            group_digits(m.reference_params),
            shown
        );
    }
    outln!(
        "\nCandidates above are layers (--granularity layer, the default). --granularity nested adds each \
         layer's children,\nany of which a plan may checkpoint instead of the whole layer: residual blocks \
         (layer3.17), BERT's\nencoder.layer.N.attention / .intermediate / .output, GPT-2's h.N.attn / h.N.mlp; \
         --granularity block offers only the children."
    );
    Ok(ExitCode::SUCCESS)
}
