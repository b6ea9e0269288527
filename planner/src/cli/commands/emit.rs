//! `ckptune emit KIND plan.json`: the snippet for a plan written earlier (`cli::snippets`).

use std::process::ExitCode;

use anyhow::Result;
use ckptune_solver::formats::{self, PlanJson};

use crate::cli::args::EmitArgs;
use crate::cli::output::outln;
use crate::cli::snippets::snippet;

pub fn emit_cmd(a: EmitArgs) -> Result<ExitCode> {
    let plan: PlanJson = formats::read_tagged(&a.plan, formats::PLAN_FORMAT)?;
    let text = snippet(&plan, a.kind)?;
    outln!("{}", text.trim_end());
    Ok(ExitCode::SUCCESS)
}
